"""flash-attn attention backend for corerun."""

__version__ = "0.1.0"
