"""The `sandboxed` runtime handler: VM-like pods whose workload runs in a separate guest, reached
through a per-pod sandbox shim and an in-guest agent."""
