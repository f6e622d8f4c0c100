"""Paged attention on CPU for corerun (a C++ kernel reading the KV cache in place)."""

__version__ = "0.1.0"
