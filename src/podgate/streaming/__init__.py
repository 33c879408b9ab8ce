"""podgate.streaming."""
