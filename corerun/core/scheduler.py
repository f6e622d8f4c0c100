"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1's unified step).

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Running sequences go first (a decode one token, a chunked prefill the rest of its prompt within the
budget), then waiting ones in arrival order while budget, cap and free blocks allow.  When a running
sequence cannot get a block, the youngest running one is preempted (blocks freed, recomputed later):
no request is lost, and the oldest always makes progress.  Each batch is a message of plain values
(``core/batch.py``); the result comes back through :meth:`Scheduler.update_from_output`, drafts
through :meth:`Scheduler.update_draft_token_ids`: the scheduler never calls up.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable

from corerun.core.batch import _NOTHING_IN_FLIGHT, InFlight, ScheduledBatch, StepResult, Told, make_batch
from corerun.core.in_flight import InFlightSteps
from corerun.core.sequence import Sequence, SequenceStatus, pools_every_token, verified_tokens
from corerun.errors import StepError
from corerun.lora.slots import LoRASlots
from corerun.protocols.kv_cache import KVCacheManager

__all__ = ["ScheduledBatch", "Scheduler", "SchedulingError", "StepResult"]

logger = logging.getLogger("corerun.engine")
PREEMPTION_WARNINGS = (1, 10, 100)  # the preemptions that log a warning; then every 100th
FINISHED = SequenceStatus.FINISHED
_EMPTY: frozenset[int] = frozenset()


class SchedulingError(StepError):
    """The KV-cache manager raised while the scheduler worked on ``seq`` (``None`` when no sequence was current).

    The scheduler's own state stays consistent: ``seq`` is still in ``running`` or ``waiting``, so the
    engine can end it (and only it) with an error; allocations already made for others in the same
    call are kept, and the next ``schedule()`` reuses them.
    """

    def __init__(self, seq: Sequence | None, cause: BaseException) -> None:
        self.seq, self.cause = seq, cause
        super().__init__(f"{type(cause).__name__}: {cause}")


class Scheduler(InFlightSteps):
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        max_model_len: int = 1 << 62,
        eos_token_ids: frozenset[int] = frozenset(),
        kv_name: str | None = None,
        num_spec_tokens: int = 0,
        max_loras: int = 0,
    ) -> None:
        self.kv = kv_cache
        self.kv_name = kv_name or getattr(kv_cache, "name", type(kv_cache).__name__)  # (for messages)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.num_spec_tokens = num_spec_tokens  # drafts a decode may carry: placeholders under asynchronous scheduling
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self._forks: dict[int, list[Sequence]] = {}  # n > 1: head seq_id -> samples queued once its prompt is computed
        self._current: Sequence | None = None  # the sequence the KV-cache manager is working on
        self.told = Told()  # what the runner was told of each request (protocol version 3)
        self._finished: list[int] = []  # seq_ids finished since the last batch
        self._seqs: dict[int, Sequence] = {}  # seq_id -> every sequence queued, running or scheduled, until it finishes
        # asynchronous scheduling: seq_id -> what the step still running does for it (corerun.core.in_flight)
        self.in_flight: dict[int, InFlight] = {}
        self._moved: set[int] = set()  # preempted while in flight: their K/V of that step are gone
        self._guessed: dict[int, int] = {}  # scheduled from placeholder counts: seq_id -> draft slots held (see settle)
        # pipeline parallelism: seq_ids in a micro-batch still in flight; never scheduled again or preempted until it is back
        self.busy: set[int] = set()
        self.max_batch_seqs = max_num_seqs  # requests in one batch (pipeline parallelism: max_num_seqs / stages)
        # LoRA (max_loras > 0): the adapters' device slots, and the slot each running request holds
        self.lora_slots = LoRASlots(max_loras) if max_loras else None
        self.lora_slot_of = self.told.lora_slot_of  # seq_id -> the slot it holds (told to the runner)

    def add(self, seq: Sequence, forks: Iterable[Sequence] = ()) -> None:
        """Queue ``seq``; ``forks``: the other samples of its ``n > 1`` request, queued once its prompt is computed."""
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq
        forks = list(forks)
        if forks:
            self._forks[seq.seq_id] = forks
            self._seqs.update((f.seq_id, f) for f in forks)

    def seqs_of(self, batch: ScheduledBatch) -> list[Sequence | None]:
        """The sequence of each row of ``batch``; ``None`` for one finished since."""
        get = self._seqs.get
        return [get(sid) for sid in batch.req_ids]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    # ----------------------------------------------------------------- step
    def schedule(self) -> ScheduledBatch:
        """The next step's batch. Raises :class:`SchedulingError` naming the sequence the KV-cache manager failed on."""
        self._current, self._guessed = None, {}
        try:
            return self._schedule()
        except Exception as exc:
            raise SchedulingError(self._current, exc) from exc

    def _schedule(self) -> ScheduledBatch:
        scheduled: dict[int, tuple[Sequence, int, int]] = {}  # seq_id -> (seq, tokens scheduled, computed count)
        preempted: list[Sequence] = []
        drafts: dict[int, list[int]] = {}
        budget = self._schedule_running(self.max_num_batched_tokens, scheduled, drafts, preempted)
        resumed = self._admit(budget, scheduled) if self.waiting and budget > 0 and not preempted else []
        if self._guessed:
            self._guessed = {sid: k for sid, k in self._guessed.items() if sid in scheduled}
        finished: frozenset[int] = _EMPTY
        if scheduled and self._finished:  # (an empty batch reaches no runner: the finished ids wait for the next one)
            finished, self._finished = frozenset(self._finished), []
        new_reqs, new_tokens, changes = self.told.describe(scheduled, frozenset(resumed) if resumed else _EMPTY, self.in_flight)
        if new_reqs:
            self._seqs.update((r.seq_id, scheduled[r.seq_id][0]) for r in new_reqs)  # (the draft model's scheduler puts its own)
        return make_batch(scheduled, tuple(new_reqs), new_tokens, changes,
                          {sid: tuple(d) for sid, d in drafts.items() if sid in scheduled} if drafts else {}, finished,
                          frozenset(s.seq_id for s in preempted) if preempted else _EMPTY)

    def _schedule_running(self, budget: int, scheduled: dict, drafts: dict, preempted: list[Sequence]) -> int:
        """Running sequences, oldest first: a decode one token (and its drafts), a chunked prefill the rest of
        its prompt within ``budget``; the youngest is preempted when blocks run out.  Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.max_batch_seqs:
            seq = self.running[i]
            ahead = self.in_flight.get(seq.seq_id, _NOTHING_IN_FLIGHT)
            if ahead.last or seq.seq_id in self.busy:  # its token in flight is its last (max_tokens, max_model_len): nothing to schedule
                i += 1
                continue
            computed = seq.num_computed_tokens + ahead.computed
            left = len(seq.token_ids) + ahead.appended - computed
            n = min(left, budget)
            if not self.chunked_prefill and n < left:
                break  # whole prefills only: wait for a step with room
            if n == 1 and (seq.draft_token_ids or (ahead.appended > 0 and self.num_spec_tokens > 0)):
                k = self._schedule_drafts(seq, computed, left, budget, ahead.appended, scheduled, drafts)
                if k:
                    budget -= k
                    i += 1
                    continue
            if not self._allocate(seq, computed + n) and not self._make_room(seq, computed + n, preempted):
                break  # seq itself was preempted, or every younger request is in flight
            scheduled[seq.seq_id] = (seq, n, computed)
            budget -= n
            i += 1
        return budget

    def _schedule_drafts(self, seq: Sequence, computed: int, left: int, budget: int, appended: int,
                         scheduled: dict, drafts: dict) -> int:
        """A decode with drafts (or, after a step in flight, slots for as many as it may get): scheduled only
        where their slots are free, never by a preemption.  Returns the tokens scheduled (0: none)."""
        guess = left == 1 and appended > 0 and self.num_spec_tokens > 0  # a decode after the step in flight
        if guess:
            d = [-1] * max(min(self.num_spec_tokens, budget - 1, seq.tokens_left(self.max_model_len) - appended - 1), 0)
            self._guessed[seq.seq_id] = 0
        else:
            d = seq.draft_token_ids[: budget - 1]
        if not d or budget <= 1 or not self._allocate(seq, computed + 1 + len(d)):
            return 0
        if guess:
            self._guessed[seq.seq_id] = len(d)
        else:
            drafts[seq.seq_id] = d
        scheduled[seq.seq_id] = (seq, 1 + len(d), computed)
        return 1 + len(d)

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Preempt the youngest running sequences until ``seq`` gets its slots; False when it cannot (it was
        preempted itself, or every younger request is in flight: wait for one to come back)."""
        while (victim := self._victim()) is not None:
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
            if self._allocate(seq, num_tokens):
                return True
        return False

    def _admit(self, budget: int, scheduled: dict) -> list[int]:
        """Waiting sequences in arrival order (preempted ones were put at the front) while the budget, the
        sequence cap and the free blocks allow; returns the seq_ids of those resumed after a preemption."""
        resumed: list[int] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(scheduled) < self.max_batch_seqs:
            seq = self._current = self.waiting[0]
            if self.lora_slots is not None and not self._lora_ready(seq):
                break  # its adapter waits for a slot, and everything behind it waits too: no adapter starves
            if seq.num_computed_tokens == 0 and not seq.wants_prompt_logprobs and not pools_every_token(seq):
                # (prompt logprobs and mean / cls pooling need the prompt's hidden states: no prefix reuse)
                seq.num_computed_tokens = self.kv.get_computed_prefix(seq.seq_id, seq.token_ids)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if not self.chunked_prefill and n < remaining:
                self._release(seq)
                break
            if not self._allocate(seq, seq.num_computed_tokens + n):
                self._release(seq)
                break
            self.waiting.popleft()
            if seq.lora is not None and self.lora_slots is not None:
                self.lora_slot_of[seq.seq_id] = self.lora_slots.acquire(seq.lora.lora_int_id)  # (available: checked)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = (seq, n, seq.num_computed_tokens)
            budget -= n
            if seq.num_preemptions:
                resumed.append(seq.seq_id)
        return resumed

    def rewind(self, seq: Sequence, num_tokens: int) -> None:
        """``seq``'s tokens past ``num_tokens`` were replaced (a draft model's copy): computed and told again."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        self.told.rewind(seq.seq_id, num_tokens)

    def update_draft_token_ids(self, drafts: dict[int, list[int]]) -> None:
        """Speculative decoding: the drafts proposed for each running sequence (seq_id -> tokens); they
        are verified when it is next scheduled as a decode.  A running sequence not named has none."""
        for seq in self.running:
            seq.draft_token_ids = drafts.get(seq.seq_id, [])

    def _victim(self) -> Sequence | None:
        """The youngest running sequence not in a micro-batch in flight (pipeline parallelism), to preempt."""
        if not self.busy:
            return self.running[-1]
        return next((s for s in reversed(self.running) if s.seq_id not in self.busy), None)

    def _allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """``allocate_slots``; the ids it returns (the table's new entries) are noted for the runner."""
        self._current = seq
        ids = self.kv.allocate_slots(seq.seq_id, num_tokens)
        if ids:
            self.told.grew(seq.seq_id, ids)
        return ids is not None

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks ``seq`` holds beyond ``num_tokens`` tokens (``KVCacheManager.trim``, when the
        manager has it; speculative decoding's rejected drafts), and tell the runner its table shrank."""
        trim = getattr(self.kv, "trim", None)
        if trim is None:
            return
        kept = trim(seq.seq_id, num_tokens)
        if not isinstance(kept, int) or isinstance(kept, bool):
            raise TypeError(
                f"KVCacheManager.trim({seq.seq_id}, {num_tokens}) returned {kept!r}; protocol version 2 wants the "
                "number of blocks the table keeps (an int)"
            )
        self.told.trimmed(seq.seq_id, kept)

    def _lora_ready(self, seq: Sequence) -> bool:
        """Before admitting ``seq``: its blocks keyed by its adapter (prefix caching never shares KV across
        adapters); ``False`` when its adapter has no slot and cannot get one now."""
        lora = seq.lora
        set_key = getattr(self.kv, "set_extra_key", None)
        if set_key is not None:
            set_key(seq.seq_id, None if lora is None else ("lora", lora.lora_int_id))
        return lora is None or self.lora_slots.available(lora.lora_int_id)  # type: ignore[union-attr]

    def _unpin_lora(self, seq: Sequence) -> None:
        slot = self.lora_slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.lora_slots.release(slot)  # type: ignore[union-attr]

    def _release(self, seq: Sequence) -> None:
        """Undo a failed admission: drop the prefix blocks it claimed."""
        self._current = seq
        self.kv.free(seq.seq_id)
        self.told.forget(seq.seq_id)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self._current = seq
        self.kv.free(seq.seq_id)  # first: if it raises, seq is still running, whole
        self.told.forget(seq.seq_id)
        self.running.remove(seq)
        self._unpin_lora(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        if seq.seq_id in self.in_flight:
            self._moved.add(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self.num_preemptions in PREEMPTION_WARNINGS or self.num_preemptions % PREEMPTION_WARNINGS[-1] == 0:
            kv = self.kv
            logger.warning(
                "KV cache full: request %r preempted, its %d tokens to be computed again (%d preemption(s) so far; "
                "the cache holds %d blocks of %d tokens). Throughput and latency suffer: give the cache more room "
                "(kv_cache.cpu_memory_gb on a CPU, kv_cache.memory_fraction on a GPU, or kv_cache.num_blocks), or "
                "lower scheduler.max_num_seqs", seq.request_id, seq.num_tokens, self.num_preemptions,
                kv.num_blocks, kv.block_size,
            )

    def stuck(self, batch: ScheduledBatch) -> tuple[Sequence, str] | None:
        """After an empty ``batch``: with nothing running and nothing preempted, the head of the queue
        can never be scheduled (the next call would see the same state); it and the reason, or None."""
        if batch.preempted_ids or self.running or not self.waiting:
            return None
        head, kv = self.waiting[0], self.kv
        return head, (
            f"request {head.request_id!r} ({head.num_tokens} tokens) cannot be scheduled although no other request "
            f"holds blocks: KV-cache manager '{self.kv_name}' refused its slots "
            f"({kv.num_free_blocks} of {kv.num_blocks} blocks of {kv.block_size} free), or it does not fit "
            f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens} with chunked_prefill off"
        )

    # ------------------------------------------------------------- the step's result
    def update_from_output(self, batch: ScheduledBatch, result: StepResult) -> tuple[list[Sequence], dict[int, str]]:
        """Apply a step's result: computed counts and cached blocks, each row's tokens until one ends the
        request (a stop token, the length, a logits processor), rejected drafts' blocks given back, an ``n > 1``
        request's other samples queued once its prompt is computed.  Returns the sequences that got a token,
        and ``seq_id -> message`` for those the KV-cache manager failed on (the caller ends them)."""
        moved, self._moved, self.in_flight = self._moved, set(), {}
        now = time.perf_counter()
        seqs = self.seqs_of(batch)
        emitted = {batch.req_ids[r]: result.emitted(j) for j, r in enumerate(result.rows)} if batch.drafts else {}
        failed: dict[int, str] = {}
        for seq, n in zip(seqs, batch.num_scheduled):
            if seq is None or seq.seq_id in moved or seq.status is FINISHED:
                continue
            kv_tokens = seq.token_ids
            d = batch.drafts.get(seq.seq_id)
            if d:
                n, kv_tokens = verified_tokens(seq, n, d, emitted.get(seq.seq_id, []))
            seq.num_computed_tokens += n
            try:
                self._current = seq
                self.kv.cache_blocks(seq.seq_id, kv_tokens, seq.num_computed_tokens)
            except Exception as exc:
                failed[seq.seq_id] = f"caching the blocks of request {seq.request_id!r}: {type(exc).__name__}: {exc}"
            if seq.seq_id in self._forks and seq.seq_id not in failed and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.waiting.extendleft(reversed(self._forks.pop(seq.seq_id)))  # n > 1: the other samples
        touched: list[Sequence] = []
        for j, row in enumerate(result.rows):
            seq = seqs[row]
            if seq is None or seq.seq_id in failed or seq.status is FINISHED:
                continue
            touched.append(seq)
            why = result.ended.get(row)
            if why is not None and why != "stop":  # an error (non-finite logits, a processor's): no token taken
                seq.error = why
                self.finish(seq, "error")
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            before = len(seq.token_ids)
            for token in result.emitted(j):
                reason = self._append(seq, token)
                if reason is not None:
                    break
            else:
                reason = why  # a logits processor's end (a grammar completed)
            if reason is not None:
                self.finish(seq, reason)
                continue
            self.told.sampled(seq.seq_id, before, len(seq.token_ids))  # (the runner recorded them)
            if seq.seq_id in batch.drafts and seq.seq_id not in self._guessed:  # (guessed: trimmed when settled)
                self._trim_drafts(seq, failed)
        if result.pooled:
            self._pooled(seqs, result.pooled, failed, touched)
        return touched, failed

    def _trim_drafts(self, seq: Sequence, failed: dict[int, str]) -> None:
        """The blocks of ``seq``'s rejected drafts go back (``failed`` notes a KV-cache manager raising)."""
        try:
            self.trim(seq, len(seq.token_ids))
        except Exception as exc:
            failed[seq.seq_id] = f"trimming the blocks of request {seq.request_id!r}: {type(exc).__name__}: {exc}"

    def _pooled(self, seqs: list[Sequence | None], pooled: dict, failed: dict[int, str], touched: list[Sequence]) -> None:
        """Embedding requests end when their prompt is computed, with their pooled vector."""
        for row, vector in pooled.items():
            seq = seqs[row]
            if seq is None or seq.seq_id in failed or seq.status is FINISHED:
                continue
            seq.pooled = vector
            touched.append(seq)
            self.finish(seq, "stop")

    def _append(self, seq: Sequence, token: int) -> str | None:
        """Append one sampled token; the reason it ends the request (a stop token, the length), if any."""
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        p, num_tokens = seq.params, len(seq.token_ids)
        num_output = num_tokens - len(seq.prompt_token_ids)
        if token in p.stop_token_ids and num_output > p.min_tokens - 1:
            seq.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids and num_output >= max(p.min_tokens, 1):
            return "stop"
        if num_output >= p.max_tokens or num_tokens >= self.max_model_len:  # (Sequence.tokens_left: none left)
            return "length"
        return None

    # ------------------------------------------------------------- finishing
    def finish(self, seq: Sequence, reason: str, *, keep: int | None = None) -> None:
        """Take ``seq`` out of the queues, mark it finished, then free its blocks (last: a KV-cache manager
        raising in ``free`` is logged, and ``seq`` is finished either way); ``keep``: drop its tokens past the
        first ``keep`` (a stop string met before its last token).  Already finished: only those change."""
        if keep is not None and keep < seq.num_tokens:
            self.num_generated_tokens -= seq.num_tokens - keep
            del seq.token_ids[keep:]
        if seq.is_finished:
            seq.finish_reason = reason
            return
        seq.finish_time = time.perf_counter()
        seq.draft_token_ids = []
        forks = self._forks.pop(seq.seq_id, ())  # n > 1 samples never queued: they end the same way
        for f in forks:
            f.status, f.finish_reason, f.error, f.finish_time = SequenceStatus.FINISHED, reason, seq.error, seq.finish_time
            self._seqs.pop(f.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._unpin_lora(seq)
        self.told.forget(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        self._finished.append(seq.seq_id)
        try:
            self.kv.free(seq.seq_id)
        except Exception as exc:
            logger.error("KV-cache manager '%s' failed to free the blocks of request %r: %s: %s",
                         self.kv_name, seq.request_id, type(exc).__name__, exc)

