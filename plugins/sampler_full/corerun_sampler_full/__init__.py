"""full sampling pipeline for corerun: penalties, top-k, top-p, min-p, logprobs, seeds."""

__version__ = "0.1.0"
