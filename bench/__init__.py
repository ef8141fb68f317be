"""Benchmark harness (not tests): `make bench` or `python -m bench.run [--quick]`.

Every number it prints is measured in the same invocation; ratios against the machine's measured
matmul peak and memory bandwidth make runs on different (or noisy) machines comparable.
"""
