"""podgate in front of an existing CRI runtime (containerd, CRI-O): a pass-through CRI proxy
that answers PortForward itself for the pods it is told to."""
