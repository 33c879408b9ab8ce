"""podgate.runtime: pods and containers in Linux namespaces, and their CRI service."""
