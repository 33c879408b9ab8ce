"""podgate.proto.spdy."""
