"""Port-forward backends: each opens a byte stream to a port inside a pod."""
