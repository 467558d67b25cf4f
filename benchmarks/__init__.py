"""Benchmarks: cost of every backpack extension relative to a plain forward + backward.

Run `python -m benchmarks.run --help` (or `make bench`); see benchmarks/README.md.
"""
