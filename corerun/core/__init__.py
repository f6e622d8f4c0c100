"""Requests and their scheduling: ``Sequence`` (a request's tokens and state) and ``Scheduler`` (which
sequences run in a step, and the ``ScheduledBatch`` that states the step's changes). Imports only
the protocols below it."""
