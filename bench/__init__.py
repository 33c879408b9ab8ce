"""Port-forward throughput and connection-setup benchmarks for podgate (`make bench`)."""
