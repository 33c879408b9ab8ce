"""podgate.proto.wschannel."""
