"""podgate.cli."""
