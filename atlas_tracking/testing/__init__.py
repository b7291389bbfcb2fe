"""Shared by the tests, the examples and the benchmarks: tiny models, demo data, readers of tracker files.

Nothing in the package imports this folder; it may import anything in the package.
"""
