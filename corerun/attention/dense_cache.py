"""Moved to :mod:`corerun.sdk.attention`; this name stays for existing imports."""

from corerun.sdk.attention import DenseKVCache

__all__ = ["DenseKVCache"]
