"""pipegoose's benchmark suite: ``python -m benchmarks.run`` (see benchmarks/README.md for method and byte counts)."""
