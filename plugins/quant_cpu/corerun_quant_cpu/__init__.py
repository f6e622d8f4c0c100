"""GGUF block formats multiplied in place on CPU for corerun (C++ kernels that never materialise the float weight),
and dense bfloat16 weights repacked for one-token steps (``dense_cpu``)."""

__version__ = "0.1.0"
