"""Triton paged attention for corerun (runs on CPU in the Triton interpreter)."""

__version__ = "0.1.0"
