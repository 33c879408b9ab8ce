"""The Linux layer of the runtime: namespaces, the pod holder process and the container shim."""
