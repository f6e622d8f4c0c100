"""Recording a step's calls once and replaying them without the model's Python: the ``replay`` graph runner's tape.

A decode step of a small model on a CPU spends about as long in Python between its kernels (module calls,
argument checks, allocations, the dispatcher) as in the kernels themselves.  A CUDA graph removes that on a
GPU; :func:`record` is the CPU's equivalent.  It runs one step and keeps every call that computes, each with
its arguments bound; :meth:`Tape.replay` runs the kept calls again, in order, on the same buffers.

What is kept, and how:

- every torch operator the step dispatches (``aten`` and custom ``torch.ops``) is seen by a dispatch mode:
  a view or an allocation needs nothing at replay; an operator that writes its arguments (``mul_``, a
  kernel with an ``out`` argument) is kept as it was called; one that returns new tensors is kept as "call
  it again and copy what it returns into the tensors it returned while recording", so that later calls
  find their inputs where they read them;
- a native call that torch does not see (a C function through ``ctypes``) must be made through
  :func:`native`, which keeps it; a component that calls C directly and does not is invisible to the tape
  (the runner's check below catches what that breaks);
- every tensor made while recording is held by the tape, so its memory stays where the calls read it.

What a recorded step must respect:

- every value a call takes by value is frozen: shapes, pointers (``native``'s ``threads_at`` marks a thread count
  to be read again at each replay).  What changes from step to step (token ids, positions, lengths, block tables, slots) must be read from tensors, and
  those tensors must be the ones the runner refills (its static inputs), not copies made while recording;
- Python that decides from the data cannot be replayed: an operator whose result is a Python value or whose
  output shape depends on values (``.item()``, ``nonzero``, a boolean mask), ``Tensor.tolist()`` and
  ``Tensor.numpy()`` (which read the data without an operator; guarded on the recording thread only) raise
  :class:`NotRecordable` while recording, and the runner runs such steps eagerly.  Other ways of reading the
  data (the buffer protocol, ``data_ptr()`` arithmetic in Python) are not seen: the runner's check is the net.

The runner checks each recording before it trusts it (:class:`corerun.graph.replay.ReplayGraphRunner`): other
tokens per row, at a position in a second block, after a decoy step wrote other K/V to the same slots; the tape
replays, the same step runs eagerly, and the tape is kept only when both give the same hidden states.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NotRecordable", "Tape", "native", "record", "recording"]


class NotRecordable(RuntimeError):
    """The step did something a tape cannot replay (named in the message)."""


class _State(threading.local):
    tape: "Tape | None" = None


_state = _State()


def recording() -> "Tape | None":
    """The tape this thread is recording into, or ``None`` (a step running eagerly)."""
    return _state.tape


def native(fn: Callable[..., Any], *args: Any, check: Callable[[Any], None] | None = None,
           threads_at: int | None = None) -> Any:
    """``fn(*args)``, kept by the tape being recorded, if any; returns what ``fn`` returned.

    ``fn``: a call torch does not see (a ``ctypes`` function); its arguments are bound as they are, so pass
    addresses of tensors that stay put and numbers that do not change from step to step.  ``check``: called
    with the result when it is truthy (a C function's error code), now and at every replay; it raises.
    ``threads_at``: the position in ``args`` (negative from the end) of a thread count, which a replay takes
    from ``torch.get_num_threads()`` at each call (the runner sets it per step: ``threads: auto``)."""
    tape = _state.tape
    rc = fn(*args) if tape is None else tape.call(fn, *args, check=check, threads_at=threads_at)
    if rc and check is not None:
        check(rc)
    return rc


_REFUSED_TAGS = (torch.Tag.data_dependent_output, torch.Tag.nondeterministic_seeded)


def _integer_indexing(func: Any, args: tuple) -> bool:
    """``x[int_tensor]`` (``aten.index.Tensor`` without a boolean mask): its shape follows the indices' shapes only."""
    if func is not torch.ops.aten.index.Tensor or len(args) < 2:
        return False
    return all(i is None or (isinstance(i, torch.Tensor) and not i.is_floating_point() and i.dtype not in (torch.bool, torch.uint8))
               for i in args[1])


class Tape:
    """The calls of one recorded step; :meth:`replay` runs them again."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[[], Any], Callable[[Any], None] | None, str]] = []
        self.held: list[torch.Tensor] = []  # every tensor made while recording: its memory stays put
        self._inside = 0  # > 0 while a kept call runs: the operators it dispatches are its own

    def call(self, fn: Callable[..., Any], *args: Any, check: Callable[[Any], None] | None = None,
             threads_at: int | None = None) -> Any:
        """Run ``fn(*args)`` now and keep it; ``check`` and ``threads_at`` as for :func:`native`."""
        self._inside += 1
        try:
            result = fn(*args)
        finally:
            self._inside -= 1
        if threads_at is None:
            kept: Callable[[], Any] = functools.partial(fn, *args)
        else:
            k = threads_at % len(args)
            head, tail = args[:k], args[k + 1 :]

            def kept() -> Any:
                return fn(*head, torch.get_num_threads(), *tail)

        self.calls.append((kept, check, getattr(fn, "__name__", repr(fn))))
        return result

    def replay(self) -> None:
        """Run every kept call again, in order."""
        for call, check, _ in self.calls:
            if check is None:
                call()
                continue
            rc = call()
            if rc:
                check(rc)

    def __len__(self) -> int:
        return len(self.calls)

    # called by the dispatch mode while recording
    def _hold(self, result: Any) -> None:
        self.held.extend(t for t in tree_leaves(result) if isinstance(t, torch.Tensor))

    def _operator(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._inside:  # part of a kept call: replayed with it
            result = func(*args, **kwargs)
            self._hold(result)
            return result
        if any(tag in func.tags for tag in _REFUSED_TAGS) or (
            torch.Tag.dynamic_output_shape in func.tags and not _integer_indexing(func, args)
        ):
            raise NotRecordable(
                f"{func} ran while recording: its result depends on the data (or on a random stream), which a "
                "replay cannot repeat"
            )
        result = func(*args, **kwargs)
        self._hold(result)
        if func.is_view or func in _ALLOCATIONS:
            return result  # metadata or fresh memory: nothing to run again
        name = str(func)
        if func._schema.is_mutable:  # writes its arguments: run it again as it was called
            self.calls.append((functools.partial(func, *args, **kwargs), None, name))
            return result
        outs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if any(not isinstance(r, torch.Tensor) for r in tree_leaves(result)):
            raise NotRecordable(f"{func} returned a Python value while recording; a replay cannot use it")
        self.calls.append((functools.partial(_again_into, func, args, kwargs, outs), None, name))
        return result


_aten = torch.ops.aten
_ALLOCATIONS = frozenset({
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default, _aten.new_empty.default,
    _aten.new_empty_strided.default,
})


def _again_into(func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
    """Replay of an operator that returns new tensors: call it again, copy its results where they were."""
    fresh = [t for t in tree_leaves(func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
    for kept, new in zip(outs, fresh):
        if kept.shape != new.shape:  # an output shape that follows the data (boolean indexing)
            raise RuntimeError(f"replay: {func} returned shape {list(new.shape)}, recorded {list(kept.shape)}")
        kept.copy_(new)


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.tape._operator(func, args, kwargs or {})


def _refuse_on_recording_thread(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.<name>`` that raises :class:`NotRecordable` on a thread that is recording (elsewhere: the original).
    ``tolist`` and ``numpy`` read a tensor's values without dispatching an operator, so the mode cannot see them."""

    @functools.wraps(original)
    def guarded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _state.tape is not None and not _state.tape._inside:
            raise NotRecordable(f"Tensor.{name}() ran while recording: Python read the data, which a replay cannot repeat")
        return original(self, *args, **kwargs)

    guarded.corerun_replay_guard = True  # type: ignore[attr-defined]
    return guarded


_READERS = ("tolist", "numpy")
_guard_lock = threading.Lock()


def _install_guards() -> None:
    with _guard_lock:
        for name in _READERS:
            current = getattr(torch.Tensor, name)
            if not getattr(current, "corerun_replay_guard", False):
                setattr(torch.Tensor, name, _refuse_on_recording_thread(name, current))


@contextmanager
def record() -> Iterator[Tape]:
    """Record this thread's calls into a new :class:`Tape` while the block runs (see the module docstring)."""
    if _state.tape is not None:
        raise RuntimeError("record(): this thread is already recording a step")
    _install_guards()  # once per process; they only act on a thread that is recording
    tape = Tape()
    _state.tape = tape
    try:
        with _Recorder(tape):
            yield tape
    finally:
        _state.tape = None
