"""Moved to :mod:`corerun.sdk.sampling`; these names stay for existing imports."""

from corerun.sdk.sampling import _exponential_, exponential_race, row_seed

__all__ = ["exponential_race", "row_seed", "_exponential_"]
