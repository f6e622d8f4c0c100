"""GGUF block formats multiplied in place on CPU for corerun (C++ kernels that never materialise the float weight)."""

__version__ = "0.1.0"
