"""Tensor-parallel building blocks the models use: ``sharding`` (which heads / features / vocabulary
rows a rank holds), ``group`` (the collectives), ``process_group`` (backend and group setup) and
``errors``. The process machinery that drives the ranks lives one layer up, in ``corerun.executor``;
the parallel layers themselves in ``corerun.models.parallel_layers``."""
