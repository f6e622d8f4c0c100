"""Moved to :mod:`corerun.sdk.sampling`; these names stay for existing imports."""

from corerun.sdk.sampling import GeneratorCache, check_logits, to_device

__all__ = ["GeneratorCache", "check_logits", "to_device"]
