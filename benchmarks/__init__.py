"""tpkit benchmarks: ``python -m benchmarks [suite ...] [--tp 1 2]`` (see benchmarks/README.md)."""
