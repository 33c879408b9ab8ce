"""podgate.images: the local image service — references, content store, snapshots, image records."""
