"""podgate.aio."""
