"""Client-side port forwarding: what to forward, the engine that keeps it up, its status."""
