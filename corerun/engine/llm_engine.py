"""The engine: accepts requests, steps the scheduler and the ModelRunner, and reports outputs.

A request that is wrong is refused when it arrives, with an error naming what was wrong; a plugin
that raises inside a step ends that step's requests with an error result and the engine goes on
serving the rest.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence as Seq

from pydantic import ValidationError

from corerun.config import Config
from corerun.engine import parallel_sampling
from corerun.engine.parallel_sampling import SequenceGroup
from corerun.core.scheduler import ScheduledBatch, Scheduler, SchedulingError
from corerun.engine.stop_strings import final_text, find_stop, running_text
from corerun.core.sequence import Sequence, SequenceStatus
from corerun.errors import ConfigError, EngineClosedError, RequestError, StepError, UnsupportedError
from corerun.runner.model_runner import ModelRunner, PreparedStep, StepResult
from corerun.outputs import CompletionOutput, Logprob, RequestOutput
from corerun.protocols.sampler import LogprobsTensors
from corerun.registry import Registry
from corerun.sampling_params import SamplingParams
from corerun.spec_decode import DraftModelProposer, NgramProposer, Proposer, SpecStats

logger = logging.getLogger("corerun.engine")

Prompt = str | Seq[int]


@dataclass
class _StepInFlight:
    """Asynchronous scheduling: the step running on the step thread while the next one is scheduled."""

    sched: ScheduledBatch
    future: Future
    preemptions: list[int]  # each sequence's num_preemptions at launch (a change: preempted meanwhile)


class LLMEngine:
    def __init__(self, config: Config, registry: Registry | None = None) -> None:
        self.config = config
        self.async_scheduling = _check_async_scheduling(config)
        if config.speculative.method is not None and config.tensor_parallel_size > 1:  # (before any rank starts)
            raise ConfigError(
                f"speculative.method: {config.speculative.method!r} runs on one device only; use "
                "tensor_parallel_size: 1 or leave speculative.method unset"
            )
        if config.tensor_parallel_size > 1:  # rank 0 of a tensor-parallel group (corerun.executor)
            from corerun.executor.driver import TensorParallelRunner

            self.runner: ModelRunner = TensorParallelRunner(config, registry)
        else:
            self.runner = ModelRunner(config, registry)
        self.kv = self.runner.kv_manager
        self.tokenizer = None if config.skip_tokenizer_init else _load_tokenizer(self.runner.model_dir)
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not self.eos_token_ids:
            self.eos_token_ids = frozenset({self.tokenizer.eos_token_id})
        procs = self.runner.logits_processors  # structured outputs and other logits processors need both
        procs.tokenizer, procs.eos_token_ids = self.tokenizer, self.eos_token_ids
        sc = config.scheduler
        self.proposer = self._make_proposer(config, registry)
        self.spec_stats = SpecStats()  # speculative decoding's acceptance counts (zero when it is off)
        self._draft_cap: dict[int, int] = {}  # seq_id -> drafts it may get next (below K after rejections)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            chunked_prefill=sc.chunked_prefill,
            propose=self._propose if self.proposer is not None else None,
        )
        self.requests: dict[str, Sequence] = {}
        self._group_of: dict[int, SequenceGroup] = {}  # seq_id -> its request's samples, for n > 1
        self._aborted: list[Sequence] = []  # aborted since the last take_aborted()
        # step/abort/add/release from several threads: one at a time (LLM goes through EngineLoop instead)
        self.lock = threading.RLock()
        self.closed = False  # after shutdown(): no more requests or steps
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        # asynchronous scheduling (docs/usage.md): the step in flight, and the outputs of one collected
        # outside step() (an abort waits for it) that the next step() returns
        self._in_flight: _StepInFlight | None = None
        self._collected: list[Sequence] = []
        self._unsent: ScheduledBatch | None = None  # a batch emptied before its launch (its finished ids)
        self._step_thread: ThreadPoolExecutor | None = None  # made by the first asynchronous step

    def _make_proposer(self, config: Config, registry: Registry | None) -> Proposer | None:
        """The draft proposer of ``speculative`` (docs/speculative-decoding.md), or None when it is off."""
        spec = config.speculative
        if spec.method is None:
            return None
        caps = self.runner.sampler.capabilities
        if not getattr(caps, "draft_verification", False):
            raise ConfigError(
                f"speculative.method: {spec.method!r} needs a sampler that verifies draft tokens "
                f"(SamplerCapabilities.draft_verification), and sampler '{self.runner.sampler_name}' does not "
                "declare it; use sampler: full or basic, or leave speculative.method unset"
            )
        if spec.method == "draft_model":
            return self._make_draft_proposer(config, registry)
        return NgramProposer(spec.num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _make_draft_proposer(self, config: Config, registry: Registry | None) -> DraftModelProposer:
        """``speculative.method: draft_model``: a ModelRunner of ``speculative.model`` with the target's
        settings, a cache of as many blocks as the target's plus room for each request's drafts (no
        prefix caching: its blocks hold drafts the target may reject), the target's max_model_len."""
        spec, target = config.speculative, self.runner
        slack = config.scheduler.max_num_seqs * -(-(spec.num_tokens + 1) // target.block_size)
        draft_config = config.model_copy(update={
            "model": spec.model,
            "speculative": type(spec)(),
            "kv_cache": config.kv_cache.model_copy(update={"num_blocks": target.num_blocks + slack, "prefix_caching": False}),
            "scheduler": config.scheduler.model_copy(update={"max_model_len": target.max_model_len}),
        })
        import torch

        try:
            runner = ModelRunner(draft_config, registry)
        except (ConfigError, OSError, ValueError, torch.OutOfMemoryError) as exc:
            raise ConfigError(
                f"speculative.model {spec.model!r}: the draft model cannot be loaded: {type(exc).__name__}: {exc} "
                f"(it is loaded after the model's KV cache, and its own cache has {target.num_blocks + slack} blocks: "
                "the model's plus room for drafts; with kv_cache.num_blocks: auto on a GPU, lower "
                "kv_cache.memory_fraction to leave it room)"
            ) from exc
        if runner.vocab_size != target.vocab_size:
            raise ConfigError(
                f"speculative.model {spec.model!r} has a vocabulary of {runner.vocab_size} tokens and the model "
                f"{target.vocab_size}; a draft model must share the model's tokenizer and vocabulary size"
            )
        sc = config.scheduler
        return DraftModelProposer(
            runner, spec.num_tokens, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
        )

    def _room(self, seq: Sequence, at_most: int) -> int:
        """How many drafts a decode of ``seq`` may carry (at most ``at_most``; never past max_tokens or
        max_model_len; 0 for a request that asks for logprobs or uses a logits processor: one row per step)."""
        p = seq.params
        if p.logprobs is not None or self.runner.logits_processors.wanted(p):
            return 0
        room = self._tokens_left(seq) - 1
        return min(room, at_most, self._draft_cap.get(seq.seq_id, room))

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still get before ``max_tokens`` or ``max_model_len`` ends it."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.runner.max_model_len - seq.num_tokens)

    def _propose(self, seq: Sequence, at_most: int) -> list[int]:
        """Draft tokens for a decode of ``seq`` (see :meth:`_room`)."""
        room = self._room(seq, at_most)
        if room <= 0:
            return []
        return self.proposer.draft(seq, room)  # type: ignore[union-attr]

    # ------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue one request; raises RequestError (nothing queued) when it cannot be served."""
        with self.lock:
            seq = self.make_sequence(prompt, params, request_id)
            self.queue_sequence(seq)
        return seq.request_id

    def queue_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by :meth:`make_sequence` (its request id must still be free)."""
        with self.lock:
            if self.closed:
                raise EngineClosedError("the engine was shut down; make a new one")
            if seq.request_id in self.requests:
                raise RequestError(f"request_id {seq.request_id!r} is already in use")
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)
            if seq.params.n > 1:  # the other samples are forked once this one's prompt is computed
                group = parallel_sampling.fork(seq, lambda: next(self._seq_ids))
                self._group_of.update((s.seq_id, group) for s in group.seqs)

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None) -> Sequence:
        """Validate one request and build its Sequence (not queued). Raises RequestError naming what is wrong."""
        params = params if params is not None else SamplingParams()
        if isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except ValidationError as exc:
                raise RequestError(f"invalid sampling_params: {_validation_details(exc)}") from None
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams (or a dict of its fields), got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        runner = self.runner
        n = len(token_ids)
        if n >= runner.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens, but max_model_len is {runner.max_model_len}: "
                f"it must be shorter, to leave room for at least one generated token"
            )
        try:
            params.check_vocab(runner.vocab_size)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop={list(params.stop)!r}: stop strings need a tokenizer, and this engine has none; "
                               "use stop_token_ids instead")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is not None and k > self.config.max_logprobs:
                raise RequestError(f"{field}={k} is above this engine's max_logprobs={self.config.max_logprobs}")
            if k is not None and k > runner.vocab_size:
                raise RequestError(f"{field}={k} is above the model's vocabulary size {runner.vocab_size}")
        try:
            runner.sampler.check(params)
        except (UnsupportedError, ValueError) as exc:
            raise RequestError(str(exc)) from None
        except Exception as exc:
            raise RequestError(
                f"sampler '{runner.sampler_name}' failed checking the sampling parameters: {type(exc).__name__}: {exc}"
            ) from exc
        self._check_fits(n, params)
        if runner.logits_processors.wanted(params):  # compiled here (cached), never inside a step
            try:
                runner.logits_processors.prepare(params)
            except (UnsupportedError, ValueError) as exc:
                raise RequestError(str(exc)) from None
            except Exception as exc:  # a processor that cannot be built here (PluginLoadError, ...)
                raise RequestError(f"structured output cannot be served: {type(exc).__name__}: {exc}") from exc
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        seq_id = next(self._seq_ids)
        if request_id is None:
            request_id = str(seq_id)
            while request_id in self.requests:  # a caller chose this id for another request
                seq_id = next(self._seq_ids)
                request_id = str(seq_id)
        return Sequence(
            seq_id=seq_id, request_id=request_id, prompt_token_ids=token_ids, params=params, prompt=text,
            arrival_time=time.perf_counter(),
        )

    def _check_fits(self, n: int, params: SamplingParams) -> None:
        """Refuse a request that could never be scheduled, however long it waited.

        Its K/V never exceed ``n + max_tokens - 1`` tokens (the last sampled token is not fed back),
        capped at ``max_model_len - 1``; without chunked prefill a recompute after preemption must
        also fit in one step's token budget.
        """
        runner = self.runner
        longest = min(n + params.max_tokens, runner.max_model_len) - 1
        need = -(-longest // runner.block_size)
        capacity = runner.num_blocks * runner.block_size
        if n > capacity:
            raise RequestError(
                f"the prompt alone ({n} tokens) needs {-(-n // runner.block_size)} KV-cache blocks of "
                f"{runner.block_size}, but the whole cache has {runner.num_blocks}; shorten the prompt or raise "
                f"kv_cache.num_blocks / memory"
            )
        if need > runner.num_blocks:
            raise RequestError(
                f"request needs up to {need} KV-cache blocks ({n} prompt + {params.max_tokens} max_tokens, "
                f"block size {runner.block_size}) but the whole cache has {runner.num_blocks}; "
                f"lower max_tokens to at most {runner.num_blocks * runner.block_size + 1 - n} "
                f"or raise kv_cache.num_blocks / memory"
            )
        sc = self.config.scheduler
        if not sc.chunked_prefill and longest > sc.max_num_batched_tokens:
            raise RequestError(
                f"request may need {longest} tokens computed in one step ({n} prompt + {params.max_tokens} "
                f"max_tokens, recomputed whole after a preemption) but scheduler.max_num_batched_tokens is "
                f"{sc.max_num_batched_tokens} and chunked_prefill is off; shorten the request, raise "
                f"max_num_batched_tokens, or turn chunked_prefill on"
            )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)``; every id checked against the model's vocabulary, however it was produced."""
        text = None
        if isinstance(prompt, dict):  # vLLM's {"prompt": text} / {"prompt_token_ids": ids}
            unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
            if unknown or not prompt:
                raise RequestError(
                    f"a prompt given as a dict takes 'prompt' (text) or 'prompt_token_ids' (token ids), "
                    f"got keys {sorted(map(str, prompt))}"
                )
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if isinstance(prompt, str):
            text, prompt = prompt, self._encode(prompt)
        if isinstance(prompt, (bytes, bytearray)):
            raise RequestError("prompt is bytes; give a string or a list of token ids")
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:  # numpy array / torch tensor
            prompt = prompt.tolist()
        vocab = self.runner.vocab_size
        try:
            ids = list(prompt)
        except TypeError:
            raise RequestError(
                f"prompt must be a string or a list of token ids (integers in [0, {vocab})), got {type(prompt).__name__}"
            ) from None
        if not ids:
            raise RequestError("prompt is empty; give at least one token")
        for i, t in enumerate(ids):
            try:
                if isinstance(t, (bool, float, str, bytes)):
                    raise TypeError
                t = operator.index(t)
            except TypeError:
                raise RequestError(
                    f"prompt token {i} is {t!r} ({type(t).__name__}); token ids must be integers in [0, {vocab})"
                ) from None
            if not 0 <= t < vocab:
                if text is not None:  # a tokenizer that does not match the model: refuse here, not in the step
                    raise RequestError(
                        f"the tokenizer turned the prompt into token {t} (position {i}), outside the model's "
                        f"vocabulary [0, {vocab}): the tokenizer files do not match the model's vocab_size"
                    )
                raise RequestError(f"prompt token {i} is {t}, outside the vocabulary: token ids must be in [0, {vocab})")
            ids[i] = t
        return text, ids

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise RequestError("prompt is empty; give at least one token")
        if self.tokenizer is None:
            raise RequestError(
                "prompt is text, but this engine has no tokenizer (model folder without tokenizer files, "
                "or skip_tokenizer_init); pass token ids instead"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(
                f"prompt is not valid Unicode text: character {exc.start} is a lone surrogate "
                f"({text[exc.start]!r}); give UTF-8 encodable text"
            ) from None
        try:
            return list(self.tokenizer.encode(text))
        except Exception as exc:
            raise RequestError(f"the tokenizer failed on the prompt: {type(exc).__name__}: {exc}") from None

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at once. Unknown or finished ids are ignored."""
        with self.lock:
            seq = self.requests.get(request_id)
            if seq is not None and self._in_flight is not None:  # its step ends first: it reads the blocks
                self._collected += self._collect()
            if seq is not None and not seq.is_finished:
                self._finish(seq, "abort", time.perf_counter())
                self._aborted.append(seq)
            group = self._group_of.get(seq.seq_id) if seq is not None else None
            if group is not None and not group.is_finished:  # n > 1: the other samples too
                for s in group.seqs[1:]:
                    if not s.is_finished:
                        self._finish(s, "abort", time.perf_counter())
                if seq not in self._aborted:
                    self._aborted.append(seq)

    def take_aborted(self) -> list[Sequence]:
        """The sequences :meth:`abort` ended since the last call (a step never returns them)."""
        with self.lock:
            out, self._aborted = self._aborted, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._collected)

    # ---------------------------------------------------------------- step
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token or finished.

        A plugin raising inside the step ends the requests it was working on (finish_reason
        ``"error"``, ``error`` naming the plugin) and frees their blocks; the others go on.
        """
        with self.lock:
            if self.closed:
                raise EngineClosedError("the engine was shut down; make a new one")
            touched = self._step()
            return parallel_sampling.as_requests(touched, self._group_of) if self._group_of else touched

    def _step(self) -> list[Sequence]:
        if self.async_scheduling:
            return self._step_async()
        if self.scheduler.propose is not None:  # draft_model: drafted ahead of the schedule
            self.proposer.prepare(self.scheduler.running, self._room)  # type: ignore[union-attr]
        try:
            sched = self.scheduler.schedule()
        except SchedulingError as exc:
            return self._scheduling_failed(exc)
        if self.proposer is not None:
            for seq in sched.preempted:  # computed again when it resumes: its draft state goes with its blocks
                self.proposer.release(seq.seq_id)
        if not sched:
            return self._unschedulable(sched)
        self.num_steps += 1
        try:
            result = self.runner.execute(sched, self.eos_token_ids)
        except Exception as exc:
            return self._step_failed(sched.seqs, exc)
        return self._update(sched, result)

    def _step_failed(self, seqs: list[Sequence], exc: Exception) -> list[Sequence]:
        """End only the step's requests: a plugin's StepError as it reads, anything else (a bug outside the plugins) logged too."""
        if isinstance(exc, StepError):
            return self._fail(seqs, str(exc))
        logger.exception("step failed outside any plugin", exc_info=exc)
        return self._fail(seqs, f"step failed: {type(exc).__name__}: {exc}")

    def _scheduling_failed(self, exc: SchedulingError) -> list[Sequence]:
        sc = self.scheduler
        culprits = [exc.seq] if exc.seq is not None else list(sc.running) + list(sc.waiting)[:1]
        culprits = [s for s in culprits if not s.is_finished]
        return self._fail(culprits, f"KV-cache manager '{self.runner.kv_manager_name}' failed while scheduling: {exc}")

    # ------------------------------------------------- asynchronous scheduling
    def _require_idle(self, what: str) -> None:
        if self.scheduler.has_unfinished() or self._in_flight is not None or self._collected:
            raise RuntimeError(f"{what} can be switched only while no request is running")

    def set_async_scheduling(self, on: bool) -> None:
        """Switch asynchronous scheduling on or off while no request runs (``corerun bench
        --async-scheduling both`` compares the two on one engine); on is refused where the config refuses it."""
        with self.lock:
            self._require_idle("asynchronous scheduling")
            if on:
                _check_async_scheduling(self.config.model_copy(
                    update={"scheduler": self.config.scheduler.model_copy(update={"async_scheduling": True})}))
            self.async_scheduling = on

    def set_speculative(self, on: bool) -> None:
        """Let the scheduler propose drafts, or not, while no request runs (``corerun bench --speculative
        both`` compares the two on one engine); off, a step is exactly a non-speculative engine's.
        On needs an engine built with ``speculative.method`` set."""
        with self.lock:
            self._require_idle("speculative decoding")
            if on and self.proposer is None:
                raise RuntimeError("speculative decoding can be switched on only in an engine built with "
                                   "speculative.method set")
            self.scheduler.propose = self._propose if on else None

    def _step_async(self) -> list[Sequence]:
        """Schedule step N+1 while step N runs on the step thread; then take N's tokens, drop from N+1
        the requests N ended (their slots freed, nothing of theirs run or emitted) and launch N+1.

        The scheduler counts each sampled row of N as one more token (a placeholder) and skips a request
        whose token in flight is certainly its last; N+1's inputs are prepared after N's tokens are in,
        so they hold the real ids.  Returns what N touched (what a synchronous step N returns).
        """
        touched, self._collected = [s for s in self._collected if s.finish_reason != "abort"], []
        had_in_flight = self._in_flight is not None
        try:
            sched = self.scheduler.schedule()
        except SchedulingError as exc:
            touched += self._collect()
            return touched + self._scheduling_failed(exc)
        touched += self._collect()
        if not sched:
            return touched if had_in_flight else touched + self._unschedulable(sched)
        keep = [i for i, s in enumerate(sched.seqs) if not s.is_finished]
        if len(keep) < len(sched.seqs):  # ended by step N: never run, never emitted (blocks freed by _finish)
            sched = _only(sched, keep)
            if not sched:  # nothing left to launch: what the batch tells the runner goes with the next one
                self._unsent = sched if self._unsent is None else _merged(self._unsent, sched)
                return touched
        if self._unsent is not None:
            sched, self._unsent = _merged(self._unsent, sched), None
        return touched + self._launch(sched)

    def _launch(self, sched: ScheduledBatch) -> list[Sequence]:
        """Prepare ``sched`` here and run it on the step thread; the requests it fails (nothing launched)."""
        self.num_steps += 1
        try:
            prepared = self.runner.prepare_step(sched, self.eos_token_ids)
        except Exception as exc:
            return self._step_failed(sched.seqs, exc)
        appends = [s.num_computed_tokens + n >= s.num_tokens for s, n in zip(sched.seqs, sched.num_new)]
        last = [a and self._tokens_left(s) <= 1 for s, a in zip(sched.seqs, appends)]
        self.scheduler.set_in_flight(sched, appends, last)
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, "corerun-step", initializer=_init_step_thread,
                                                   initargs=(_cuda_index(self.runner.device), self.runner.threads))
        # (the runner by weak reference: once the step is done, the step thread holds nothing of the engine)
        future = self._step_thread.submit(_run_step, weakref.ref(self.runner), prepared)
        self._in_flight = _StepInFlight(sched, future, [s.num_preemptions for s in sched.seqs])
        return []

    def _collect(self) -> list[Sequence]:
        """Wait for the step in flight (if any) and apply its tokens, as a synchronous step would."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        self.scheduler.clear_in_flight()
        try:
            result = step.future.result()
        except Exception as exc:
            return self._step_failed([s for s in step.sched.seqs if not s.is_finished], exc)
        moved = {s.seq_id for s, p in zip(step.sched.seqs, step.preemptions) if s.num_preemptions != p}
        return self._update(step.sched, result, moved)

    def _unschedulable(self, sched: ScheduledBatch) -> list[Sequence]:
        """Nothing was scheduled. With nothing running and nothing preempted, the head of the queue
        can never be scheduled (the next call would see the same state): end it instead of spinning."""
        sc = self.scheduler
        if sched.preempted or sc.running or not sc.waiting:
            return []
        head = sc.waiting[0]
        kv = self.kv
        return self._fail([head], (
            f"request {head.request_id!r} ({head.num_tokens} tokens) cannot be scheduled although no other request "
            f"holds blocks: KV-cache manager '{self.runner.kv_manager_name}' refused its slots "
            f"({kv.num_free_blocks} of {kv.num_blocks} blocks of {kv.block_size} free), or it does not fit "
            f"scheduler.max_num_batched_tokens={sc.max_num_batched_tokens} with chunked_prefill off"
        ))

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        """End ``seq``; a KV-cache manager raising while freeing is logged (the request is finished either way)."""
        seq.finish_time = now
        try:
            self.scheduler.finish(seq, reason)
        except Exception as exc:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            logger.error(
                "KV-cache manager '%s' failed to free the blocks of request %r: %s: %s",
                self.runner.kv_manager_name, seq.request_id, type(exc).__name__, exc,
            )
        self.runner.logits_processors.remove(seq.seq_id)
        self._draft_cap.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        group = self._group_of.get(seq.seq_id)
        if group is not None and group.pending and seq is group.head:  # n > 1: forks not yet queued
            parallel_sampling.finish_pending(group, reason, seq.error, now)

    def _fail(self, seqs: list[Sequence], message: str) -> list[Sequence]:
        logger.error("step failed, %d request(s) end with an error: %s", len(seqs), message)
        now = time.perf_counter()
        for seq in seqs:
            seq.error = message
            self._finish(seq, "error", now)
        return seqs

    def _update(self, sched: ScheduledBatch, result: StepResult, moved: frozenset[int] | set[int] = frozenset()) -> list[Sequence]:
        """Apply a step's result. ``moved``: sequences preempted while the step ran (asynchronous
        scheduling): they take their token, but their K/V were given up and are recomputed."""
        now = time.perf_counter()
        # everything that can fail on malformed sampler output first, before any sequence changes
        try:
            prompt_lps = {
                i: _logprob_dicts(lp, sched.seqs[i].params.prompt_logprobs or 0)
                for i, (_, lp) in result.prompt_logprobs.items()
            }
            lp_rows = None
            if result.logprobs is not None:
                lp_rows = _logprob_dicts(result.logprobs, [sched.seqs[r].params.logprobs or 0 for r in result.rows])
        except Exception as exc:
            return self._fail(sched.seqs, f"sampler '{self.runner.sampler_name}' returned malformed logprobs: "
                              f"{type(exc).__name__}: {exc}")
        failed: dict[int, str] = {}  # seq_id -> error
        emitted = {}  # speculative decoding: seq_id -> every token of the row (the first, then accepted drafts...)
        if sched.drafts:
            emitted = {sched.seqs[r].seq_id: [t, *result.more.get(r, ())] for r, t in zip(result.rows, result.sampled)}
        for seq, n in zip(sched.seqs, sched.num_new):
            if seq.seq_id in moved:
                continue
            kv_tokens = seq.token_ids
            d = sched.drafts.get(seq.seq_id)
            if d:  # K/V of rejected drafts stay in their slots, overwritten when those positions are computed
                accepted = len(emitted.get(seq.seq_id, ())) - 1
                n -= len(d) - max(accepted, 0)
                kv_tokens = seq.token_ids + emitted[seq.seq_id][:accepted] if accepted > 0 else seq.token_ids
                st = self.spec_stats
                st.num_drafts, st.num_draft_tokens = st.num_drafts + 1, st.num_draft_tokens + len(d)
                st.num_accepted_tokens += max(accepted, 0)
                # adaptive length: one past what was accepted after a rejection, doubling while all are
                # accepted (text that does not repeat itself pays for one draft token a step, not K)
                k = self.proposer.num_tokens  # type: ignore[union-attr]
                grown = min(k, max(2 * len(d), self._draft_cap.get(seq.seq_id, k)))
                self._draft_cap[seq.seq_id] = grown if accepted >= len(d) else max(accepted, 0) + 1
            seq.num_computed_tokens += n
            try:
                self.kv.cache_blocks(seq.seq_id, kv_tokens, seq.num_computed_tokens)
            except Exception as exc:
                failed[seq.seq_id] = (f"KV-cache manager '{self.runner.kv_manager_name}' failed caching the blocks "
                                      f"of request {seq.request_id!r}: {type(exc).__name__}: {exc}")
            group = self._group_of.get(seq.seq_id)
            if group is not None and group.pending and seq.seq_id not in failed:  # n > 1: fork after the prefill
                self.scheduler.waiting.extendleft(reversed(group.ready_forks()))
        for i, lps in prompt_lps.items():
            seq = sched.seqs[i]
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]
            seq.prompt_logprobs.extend(lps)
        touched: list[Sequence] = []
        for j, (row, token) in enumerate(zip(result.rows, result.sampled)):
            seq = sched.seqs[row]
            if seq.seq_id in failed:
                continue
            if row in result.more:  # accepted drafts: each token checked for a stop before the next
                self._append_more(seq, token, result.more[row], now)
                touched.append(seq)
                continue
            reason = self._append_token(seq, token, now)
            if seq.logprobs is not None and lp_rows is not None:
                seq.logprobs.append(lp_rows[j])
            if reason is None and row in result.ended:  # a logits processor's end (a grammar completed)
                reason = result.ended[row]
                if reason != "stop":
                    seq.error, reason = reason, "error"
            if reason is not None:
                self._finish(seq, reason, now)
            touched.append(seq)
        for seq in sched.seqs:
            if seq.seq_id in sched.drafts and seq.seq_id not in failed and not seq.is_finished:
                try:
                    self._trim(seq)
                except Exception as exc:
                    failed[seq.seq_id] = (f"KV-cache manager '{self.runner.kv_manager_name}' failed trimming the "
                                          f"blocks of request {seq.request_id!r}: {type(exc).__name__}: {exc}")
            if seq.seq_id in failed:
                touched += [s for s in self._fail([seq], failed[seq.seq_id]) if s not in touched]
        return touched

    def _append_more(self, seq: Sequence, first: int, more: list[int], now: float) -> None:
        """Append a speculative row's tokens one by one until one ends the request (max_tokens, a stop)."""
        for token in (first, *more):
            reason = self._append_token(seq, token, now)
            if reason is not None:
                self._finish(seq, reason, now)
                return

    def _append_token(self, seq: Sequence, token: int, now: float) -> str | None:
        """Append one sampled token; the reason it ends the request (a stop token, a length, a stop string), if any."""
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = self._stop_reason(seq, token)
        if reason is None and seq.params.stop:
            reason = self._stop_string(seq)
        return reason

    def _trim(self, seq: Sequence) -> None:
        """Give back the blocks ``seq`` took only for rejected drafts (managers with ``trim``; others keep them);
        the scheduler reports the shorter table to the runner with the next batch."""
        self.scheduler.trim(seq, seq.num_tokens)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids and seq.num_output_tokens > p.min_tokens - 1:
            seq.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids and seq.num_output_tokens >= max(p.min_tokens, 1):
            return "stop"
        if self._tokens_left(seq) <= 0:
            return "length"
        return None

    def _stop_string(self, seq: Sequence) -> str | None:
        """``"stop"`` when the text new this step completes one of the request's stop strings (corerun.engine.stop_strings)."""
        start = len(seq.text)
        text = self._detokenize(seq, seq.output_view())
        if seq.num_output_tokens < seq.params.min_tokens:
            return None
        hit = find_stop(text, seq.params.stop, start)
        if hit is None:
            return None
        seq.stop_reason = hit[1]  # type: ignore[assignment]  # the string, as vLLM reports it
        return "stop"

    # -------------------------------------------------------------- output
    def output(self, seq: Sequence | SequenceGroup) -> RequestOutput:
        """The request's output so far; for ``n > 1`` (a sequence of the request, or its group) every sample's."""
        group = seq if isinstance(seq, SequenceGroup) else self._group_of.get(seq.seq_id)
        if group is not None:
            return parallel_sampling.group_output(group, self._output_one)
        return self._output_one(seq)

    def _output_one(self, seq: Sequence) -> RequestOutput:
        ids = seq.output_token_ids
        text = self._detokenize(seq, ids) if self.tokenizer is not None else ""
        p = seq.params
        if p.stop and text and not seq.is_finished:
            text = running_text(text, p.stop, p.include_stop_str_in_output)
        elif p.stop and text and isinstance(seq.stop_reason, str):  # ended by a stop string: cut there
            start = len(self.tokenizer.decode(ids[:-1], skip_special_tokens=True))
            text = final_text(text, seq.stop_reason, start, p.include_stop_str_in_output)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(ids), finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=seq.logprobs, error=seq.error,
        )
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        if seq.finish_time is not None:
            metrics["finish_time"] = seq.finish_time
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion], finished=seq.is_finished, prompt_logprobs=seq.prompt_logprobs, metrics=metrics,
        )

    def _detokenize(self, seq: Sequence, ids: list[int]) -> str:
        """The output text so far, decoding only the new tokens (with a few tokens of left context, as
        vLLM does, so merges and multi-byte characters come out right); exact full decode at the end."""
        tok = self.tokenizer
        if seq.is_finished:
            seq.text = tok.decode(ids, skip_special_tokens=True)
            return seq.text
        prefix, read = seq.detok_prefix, seq.detok_read
        if len(ids) > read:
            before = tok.decode(ids[prefix:read], skip_special_tokens=True)
            after = tok.decode(ids[prefix:], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd"):  # hold back half a character
                seq.text += after[len(before):]
                seq.detok_prefix = max(read - 4, 0)
                seq.detok_read = len(ids)
        return seq.text

    def release(self, request_id: str) -> None:
        """Forget a finished request (the engine keeps no history of its own)."""
        with self.lock:
            seq = self.requests.get(request_id)
            group = self._group_of.get(seq.seq_id) if seq is not None else None
            if group is not None and group.is_finished:  # n > 1: once every sample is done
                for s in group.seqs:
                    self._group_of.pop(s.seq_id, None)
                del self.requests[request_id]
            elif group is None and seq is not None and seq.is_finished:
                del self.requests[request_id]

    def shutdown(self) -> None:
        """Release the KV cache and the graphs at once, and what the runner holds outside this process
        (tensor-parallel workers); the engine refuses work afterwards. Safe to call twice."""
        with self.lock:
            self.closed = True
            self._collect()
            self._collected = []
            if self._step_thread is not None:
                self._step_thread.shutdown(wait=True)
            for rid in list(self.requests):
                self.abort(rid)
            self._aborted = []
            close = getattr(self.runner, "shutdown", None)
            if close is not None:
                close()
            _free_device_memory(self.runner)
            if self.proposer is not None and self.proposer.runner is not None:  # the draft model's too
                _free_device_memory(self.proposer.runner)


def _free_device_memory(runner: object) -> None:
    """Drop ``runner``'s KV cache and graphs (where it has them)."""
    if hasattr(runner, "kv_caches"):
        runner.kv_caches = []
    if hasattr(runner, "graph"):
        runner.graph = None


def _check_async_scheduling(config: Config) -> bool:
    """``scheduler.async_scheduling``, refused where the step's token count is not known ahead."""
    if not config.scheduler.async_scheduling:
        return False
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            f"scheduler.async_scheduling: true runs on one device only (tensor_parallel_size is "
            f"{config.tensor_parallel_size}); use tensor_parallel_size: 1 or async_scheduling: false"
        )
    if config.speculative.method is not None:
        raise ConfigError(
            f"scheduler.async_scheduling: true cannot be combined with speculative.method: "
            f"{config.speculative.method!r} (a step's number of accepted tokens is not known ahead); "
            "leave speculative.method unset or use async_scheduling: false"
        )
    return True


def _only(sched: ScheduledBatch, keep: list[int]) -> ScheduledBatch:
    """``sched`` with only its sequences ``keep`` (indices, in order): the per-sequence fields follow."""
    ids = {sched.seqs[i].seq_id for i in keep}
    changes: dict[str, Any] = dict(
        seqs=[sched.seqs[i] for i in keep], num_new=[sched.num_new[i] for i in keep],
        num_decodes=sum(1 for i in keep if i < sched.num_decodes),
        drafts={k: v for k, v in sched.drafts.items() if k in ids},
    )
    if getattr(sched, "new_block_ids", None) is not None:  # protocol version 2's per-sequence changes
        changes["new_block_ids"] = {k: v for k, v in sched.new_block_ids.items() if k in ids}
        changes["resumed_ids"] = frozenset(sched.resumed_ids) & ids
    return replace(sched, **changes)


def _merged(unsent: ScheduledBatch, sched: ScheduledBatch) -> ScheduledBatch:
    """``sched`` also telling what the unlaunched ``unsent`` told: the sequences finished before it."""
    finished = getattr(unsent, "finished_ids", None)
    if not finished:
        return sched
    return replace(sched, finished_ids=frozenset(finished) | sched.finished_ids)


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index the engine's thread runs on (``cuda`` without an index: its current one); None off CUDA."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def _init_step_thread(cuda_index: int | None, threads: int) -> None:
    """The step thread runs with the engine thread's CUDA device and intra-op thread count."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if cuda_index is not None:  # (the current device is per thread)
        torch.cuda.set_device(cuda_index)


def _run_step(runner_ref: Any, prepared: PreparedStep) -> StepResult:
    """On the step thread: the forward, then sampling (torch releases the GIL inside its kernels)."""
    runner = runner_ref()
    if runner is None:  # (the engine went away meanwhile: nobody waits for this step)
        raise StepError("the engine was shut down before its step ran")
    return runner.sample_tokens(runner.execute_model(prepared))


def _validation_details(exc: ValidationError) -> str:
    """``field: message (got value)`` for each problem pydantic found, on one line."""
    parts = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field; SamplingParams has {', '.join(SamplingParams.model_fields)}"
        elif e["loc"] and "got " not in msg:
            msg += f" (got {e.get('input')!r})"
        parts.append(f"{'.'.join(map(str, e['loc']))}: {msg}" if e["loc"] else msg)
    return "; ".join(parts)


def _logprob_dicts(lp: LogprobsTensors | None, k: int | Seq[int]) -> list[dict[int, Logprob]]:
    """LogprobsTensors rows -> ``{token id: Logprob}`` dicts: column 0 (the chosen token) first, then the top ``k``.

    ``k`` is one count for every row, or one per row: a batch carries as many top columns as its
    most demanding row asked for, and each row keeps only its own (vLLM's rule: the top ``k``, plus
    the chosen token when it is not among them).
    """
    if lp is None:
        return []
    ids = lp.token_ids.tolist()
    vals = lp.logprobs.tolist()
    ranks = lp.ranks.tolist()
    ks = [k] * len(ids) if isinstance(k, int) else list(k)
    if len(ks) > len(ids):
        raise ValueError(f"{len(ids)} logprob rows for {len(ks)} requests")
    out = []
    for row_ids, row_vals, rank, row_k in zip(ids, vals, ranks, ks):
        cols = min(len(row_ids), row_k + 1)
        d: dict[int, Logprob] = {row_ids[0]: Logprob(row_vals[0], rank)}
        for c in range(1, cols):
            d.setdefault(row_ids[c], Logprob(row_vals[c], c))
        out.append(d)
    return out


def _load_tokenizer(model_dir: Path) -> Any:
    files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((model_dir / f).exists() for f in files):
        logger.info("no tokenizer files in %s: prompts must be token ids, outputs carry no text", model_dir)
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        from corerun.models.errors import ModelLoadError

        raise ModelLoadError(
            f"the tokenizer in {model_dir} needs transformers, which cannot be imported ({exc}): "
            "pip install 'corerun[hf]', or set skip_tokenizer_init: true and pass token ids"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # corrupt tokenizer.json, a bad tokenizer_config.json, ...
        from corerun.models.errors import ModelLoadError

        present = [f for f in files if (model_dir / f).exists()]
        raise ModelLoadError(
            f"cannot load the tokenizer in {model_dir} ({', '.join(present)}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else ''}; fix or remove these files, or set "
            "skip_tokenizer_init: true and pass token ids"
        ) from None
