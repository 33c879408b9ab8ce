"""podgate.node: the Kubernetes API surface kubectl needs for one node, and the gateway."""
