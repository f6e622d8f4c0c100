"""The runner's logits processors: chosen by the fields a request sets, applied between logits and sampler.

A request that sets a field some logits processor serves (``structured_outputs``) gets, per field, the
highest-priority registered processor that serves it and that ``auto`` may choose (built-in,
first-party or certified, as for attention backends).  Processors are built on first use, once per
engine.  Life of a request (its key is the ``seq_id``; each of ``n`` samples has its own):

- admission (:meth:`LogitsProcessors.prepare`, from ``LLMEngine.make_sequence``): the processor
  validates and compiles; a ``ValueError`` refuses that request alone.  ``EngineLoop`` first calls
  :meth:`LogitsProcessors.warm` on the caller's thread, so the compilation is not on the engine's;
- reaching the runner (:meth:`LogitsProcessors.add_requests`, from ``ModelRunner.prepare_step``): it is a
  user until removed; while there is none, the runner skips the processors;
- its first sampling step: ``add_request`` makes its state; every step ``apply`` masks its row, and
  ``accept`` advances the state by the sampled token (``"stop"`` ends the request);
- finish or abort (``LLMEngine._finish``): ``remove_request``.  Preemption keeps the state: the
  request's tokens are recomputed, not re-sampled, so the state is where it was.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from corerun.plugin.capabilities import PROCESSOR_PARAMS, Need
from corerun.plugin.registry import Registration, Registry

logger = logging.getLogger("corerun.runner.logits_processing")

# What each field needs installed, for the error when nothing serves it.
PROVIDERS = {"structured_outputs": "corerun-structured-output (pip install corerun-structured-output)"}


@dataclass
class _Group:
    """One processor's rows in one step."""

    processor: Any
    rows: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)


@dataclass
class _Step:
    """What :meth:`LogitsProcessors.apply` hands :meth:`LogitsProcessors.accept`: the groups it masked,
    and the rows whose processor raised (they end with that error; the others go on)."""

    groups: list[_Group] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.groups or self.failed)


def _error(proc: Any, what: str, exc: BaseException) -> str:
    who = "logits processor" if proc is None else f"logits processor '{getattr(proc, 'name', type(proc).__name__)}'"
    return f"{who} failed {what}: {type(exc).__name__}: {exc}"


class LogitsProcessors:
    """Every logits processor one engine uses, and which request holds state in which."""

    def __init__(self, registry: Registry, vocab_size: int, device: torch.device, sampler_name: str, sampler_caps: Any) -> None:
        self.registry = registry
        self.vocab_size = vocab_size
        self.device = device
        self.sampler_name = sampler_name
        self.sampler_mask = bool(getattr(sampler_caps, "logits_mask", False))
        self.tokenizer: Any = None  # set by the engine once it has loaded its tokenizer
        self.eos_token_ids: frozenset[int] = frozenset()
        self._built: dict[str, Any] = {}  # registration name -> processor
        self._users: set[int] = set()  # seq_ids of the requests at the runner that want a processor
        # some request at the runner wants a processor (from add_requests until remove); while none does, the
        # runner skips apply and accept.  A plain attribute, kept in step with _users: the runner reads it every
        # step, and a property would put this module on every decode's path
        self.in_use = False
        self._states: dict[int, list[Any]] = {}  # seq_id -> processors holding its state
        self._lock = threading.Lock()  # admission may run on another thread than the steps

    def add_requests(self, new_reqs: Sequence[Any]) -> None:
        """A step's new (or resumed) requests (``seq_id``, ``params``): those that want a processor count
        as its users until they are removed."""
        self._users.update(r.seq_id for r in new_reqs if self.wanted(r.params))
        self.in_use = bool(self._users)

    @staticmethod
    def wanted(params: Any) -> bool:
        """Whether ``params`` sets a field a logits processor serves (cheap: runs per row per step)."""
        return any(getattr(params, f, None) is not None for f in PROCESSOR_PARAMS)

    def choose(self, field_name: str) -> Registration:
        """The processor ``auto`` picks for ``field_name``; ``ValueError`` naming what to install when none."""
        eligible, passed = self.registry.auto_ranking("logits_processor", Need(self.device, params=frozenset({field_name})))
        if eligible:
            return eligible[0]
        why = "; ".join(f"'{r.name}': {w}" for r, w in passed if field_name in getattr(r.capabilities, "params", ()))
        raise ValueError(
            f"{field_name} needs a logits processor that serves it, and none is usable here"
            + (f" ({why})" if why else f"; install {PROVIDERS.get(field_name, 'one')}")
        )

    def for_params(self, params: Any) -> list[Any]:
        """The processors ``params`` uses (built on first use)."""
        fields = sorted(f for f in PROCESSOR_PARAMS if getattr(params, f) is not None)
        if not fields:
            return []
        if not self.sampler_mask:
            raise ValueError(
                f"{', '.join(fields)} needs a sampler that takes masked logits, and sampler '{self.sampler_name}' "
                "does not declare logits_mask=True in its capabilities; use sampler: full or basic"
            )
        out: list[Any] = []
        with self._lock:
            for f in fields:
                reg = self.choose(f)
                proc = self._built.get(reg.name)
                if proc is None:
                    proc = reg.create(
                        self.vocab_size, self.device, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids
                    )
                    self._built[reg.name] = proc
                if proc not in out:
                    out.append(proc)
        return out

    def prepare(self, params: Any) -> None:
        """Admission: every processor ``params`` uses validates and compiles it (``ValueError`` refuses it)."""
        for proc in self.for_params(params):
            proc.prepare(params)

    def warm(self, params_list: Sequence[Any]) -> None:
        """Compile ahead, on the caller's thread, what admission will need (admission, on the engine's
        thread between steps, then finds it cached).  Errors are left for admission to report."""
        for params in params_list:
            if params is not None and not isinstance(params, dict) and self.wanted(params):
                try:
                    self.prepare(params)
                except Exception:  # refused at admission, with its message, in the request's own error
                    pass

    def apply(self, logits: torch.Tensor, seqs: Sequence[Any]) -> _Step:
        """Mask the rows of ``seqs`` that use processors, in place; what :meth:`accept` needs afterwards.

        A processor that raises ends only its own rows' requests (with the error): their logits are
        reset to zeros so the sampler draws something harmless, which the engine then discards."""
        step = _Step()
        groups: dict[int, _Group] = {}
        for row, seq in enumerate(seqs):
            if not self.wanted(seq.params):
                continue
            procs = self._states.get(seq.seq_id)
            if procs is None:
                procs = []
                try:
                    for proc in self.for_params(seq.params):
                        procs.append(proc)
                        proc.add_request(seq.seq_id, seq.params, list(seq.output_view()))
                except Exception as exc:
                    step.failed[row] = _error(procs[-1] if procs else None, "starting the request", exc)
                    logits[row] = 0.0
                self._states[seq.seq_id] = procs  # (removed with the request, like any other)
                if row in step.failed:
                    continue
            for proc in procs:
                g = groups.setdefault(id(proc), _Group(proc))
                g.rows.append(row)
                g.keys.append(seq.seq_id)
        for g in groups.values():
            try:
                g.processor.apply(logits, g.rows, g.keys)
            except Exception as exc:
                message = _error(g.processor, "masking", exc)
                step.failed.update((r, message) for r in g.rows)
                logits[g.rows] = 0.0
                continue
            step.groups.append(g)
        return step

    def accept(self, step: _Step, sampled: Sequence[int]) -> dict[int, str]:
        """Advance each state by its row's token; row -> ``"stop"`` or an error, for rows that must end."""
        ended = dict(step.failed)
        for g in step.groups:
            rows = [r for r in g.rows if r not in ended]
            if not rows:
                continue
            keys = [k for r, k in zip(g.rows, g.keys) if r not in ended]
            try:
                results = list(g.processor.accept(keys, [sampled[r] for r in rows]))
                if len(results) != len(rows):
                    raise ValueError(f"accept returned {len(results)} results for {len(rows)} requests")
            except Exception as exc:
                ended.update((r, _error(g.processor, "taking the sampled tokens", exc)) for r in rows)
                continue
            for row, res in zip(rows, results):
                if res is not None and row not in ended:
                    ended[row] = res if res == "stop" else f"logits processor '{g.processor.name}': {res}"
        return ended

    def remove(self, seq_id: int) -> None:
        """The request ended (finished or aborted): its state goes."""
        self._users.discard(seq_id)
        self.in_use = bool(self._users)
        for proc in self._states.pop(seq_id, ()):
            try:
                proc.remove_request(seq_id)
            except Exception:  # the request is over either way
                logger.exception("logits processor %r failed removing request %d", getattr(proc, "name", proc), seq_id)

    @property
    def num_requests(self) -> int:
        """Requests holding state now (what leaks would grow)."""
        return len(self._states)
