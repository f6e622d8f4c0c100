"""temperature-only sampler for corerun."""

__version__ = "0.1.0"
