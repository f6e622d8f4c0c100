"""corerun-sampler-full: the `full` sampler (vLLM v1's pipeline: penalties, top-k, top-p, min-p, logprobs, seeds)."""

__version__ = "0.1.0"
