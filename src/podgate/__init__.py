"""podgate: exec, attach and port-forward for every kind of pod sandbox."""

__version__ = "0.1.0"
