"""Tensor-parallel execution: one model split across several processes (GPUs, or CPU processes for testing).

Each rank holds a slice of every weight: its attention heads (KV heads split, or replicated when
there are fewer KV heads than ranks), its slice of the MLP's intermediate features, and its range
of the vocabulary.  Rank 0 is the engine's own process: it schedules and samples.  Every step's
message (the scheduler's ``ScheduledBatch``) goes to ranks 1..N-1 as it is, and every rank applies
it to its own persistent batch, builds its own step inputs and runs the same forward; the commands
travel over pipes on one host and as a broadcast over torch.distributed across hosts.

Rooms (the shard arithmetic, collectives and process groups are in ``corerun.distributed``, the
parallel layers in ``corerun.models.parallel_layers``):

- ``step``           the commands rank 0 sends: the step's message, the logits rows, shutdown
- ``local``          one host: rank 0 spawns the workers and talks to them over pipes
- ``launched``       several hosts: ranks started by ``torchrun`` (or by hand), commands broadcast from rank 0
- ``worker``         the worker loop, and ``python -m corerun.executor.worker``
- ``driver``         ``TensorParallelRunner``: rank 0's ModelRunner, mirrored on the workers

Importing this package imports nothing heavy; the engine imports ``corerun.executor.driver`` only
when ``tensor_parallel_size > 1``.
"""
