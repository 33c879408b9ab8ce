"""OCI bundles for runc: config.json generation (containerd's CRI defaults), the seccomp
profile, user resolution inside a rootfs, path resolution inside a root, the runc driver, the
overlay root and the cgroups a container lives in."""
