"""Serving benchmarks: `fp8serve bench serve` and `fp8serve bench sweep`."""
