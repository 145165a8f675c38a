"""Overhead and recovery benchmarks (run one with ``python -m benchmarks.<name>``)."""
