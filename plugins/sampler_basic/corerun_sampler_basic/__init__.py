"""corerun-sampler-basic: the `basic` sampler (temperature, greedy, per-request seeds)."""

__version__ = "0.1.0"
