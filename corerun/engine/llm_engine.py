"""The engine: accepts requests, and steps schedule -> execute -> update -> outputs (vLLM's ``EngineCore.step``).
Input and output processing are ``input_processor`` and ``output_processor``, drafting ``corerun.spec_decode``,
the overlapping steps (asynchronous scheduling, pipeline stages) ``batch_queue``; a plugin raising inside a step ends that step's requests with an error and the engine serves the rest."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from typing import Any

from corerun.config import Config
from corerun.core.batch import ScheduledBatch, StepResult
from corerun.core.scheduler import Scheduler, SchedulingError
from corerun.core.sequence import Sequence, SequenceStatus
from corerun.engine import parallel_sampling
from corerun.engine.batch_queue import BatchQueue, check_async_scheduling, collect, step_async, step_stages
from corerun.engine.input_processor import InputProcessor, Limits, Prompt, load_tokenizer, sampler_check
from corerun.engine.output_processor import NO_LOGPROBS, OutputProcessor
from corerun.engine.parallel_sampling import SequenceGroup
from corerun.engine.speculation import make_spec_decoder
from corerun.lora.request import LoRARequest
from corerun.executor.select import make_runner
from corerun.errors import ConfigError, EngineClosedError, RequestError, StepError
from corerun.outputs import RequestOutput
from corerun.plugin.registry import Registry
from corerun.runner.model_runner import ModelRunner
from corerun.sampling_params import SamplingParams
from corerun.spec_decode import SpecStats

logger = logging.getLogger("corerun.engine")
FINISHED = SequenceStatus.FINISHED

__all__ = ["LLMEngine", "Prompt"]


class LLMEngine:
    def __init__(self, config: Config, registry: Registry | None = None) -> None:
        self.config = config
        self.async_scheduling = check_async_scheduling(config)
        # one device (executor inproc), or rank 0 of a tensor x pipeline placement (corerun.executor)
        self.runner: ModelRunner = make_runner(config, registry)
        runner, sc = self.runner, config.scheduler
        self.kv = runner.kv_manager
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(runner.model_dir)
        eos = frozenset(runner.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not eos:
            eos = frozenset({self.tokenizer.eos_token_id})
        self.eos_token_ids = eos
        runner.set_vocabulary(self.tokenizer, eos)  # structured outputs read both
        limits = Limits.of(config, runner.model_config, self.kv, runner.max_num_batched_tokens)
        self.inputs = InputProcessor(limits, self.tokenizer, sampler_check(runner.sampler, runner.sampler_name,
                                                                            runner.logits_processors),
                                     check_lora=runner.lora.load if runner.lora is not None else None)
        if runner.lora is not None and config.kv_cache.prefix_caching and not hasattr(self.kv, "set_extra_key"):
            raise ConfigError(
                f"lora.enabled with prefix caching needs blocks keyed by adapter, and KV-cache manager "
                f"'{runner.kv_manager_name}' has no set_extra_key; set kv_cache.prefix_caching: false or use 'paged'"
            )
        self.outputs = OutputProcessor(self.tokenizer)
        self.spec = make_spec_decoder(config, runner, registry)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=runner.max_num_batched_tokens,
            chunked_prefill=sc.chunked_prefill, max_model_len=runner.max_model_len, eos_token_ids=eos,
            kv_name=runner.kv_manager_name, num_spec_tokens=self.spec.proposer.num_tokens if self.spec else 0,
            max_loras=config.lora.max_loras if runner.lora is not None else 0,
        )
        self.requests: dict[str, Sequence] = {}
        self._group_of: dict[int, SequenceGroup] = {}  # seq_id -> its request's samples, for n > 1
        self._aborted: list[Sequence] = []  # aborted since the last take_aborted()
        # step/abort/add/release from several threads: one at a time (LLM goes through EngineLoop instead)
        self.lock = threading.RLock()
        self.closed = False  # after shutdown(): no more requests or steps
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.queue = BatchQueue(runner)  # asynchronous scheduling: the step in flight (corerun.engine.batch_queue)
        self.stages: deque[ScheduledBatch] = deque()  # pipeline parallelism: micro-batches in flight, oldest first
        self.scheduler.max_batch_seqs = -(-sc.max_num_seqs // runner.pipeline_depth)  # (one micro-batch per stage)

    @property
    def proposer(self) -> Any:
        """The draft proposer (None without speculative decoding)."""
        return self.spec.proposer if self.spec is not None else None

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding's acceptance counts (zero when it is off)."""
        return self.spec.stats if self.spec is not None else SpecStats()

    @property
    def num_generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens

    # ------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue one request; raises RequestError (nothing queued) when it cannot be served."""
        with self.lock:
            seq = self.make_sequence(prompt, params, request_id, lora_request)
            self.queue_sequence(seq)
        return seq.request_id

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                      lora_request: LoRARequest | None = None) -> Sequence:
        """Validate one request and build its Sequence (not queued). Raises RequestError naming what is wrong."""
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        seq_id = next(self._seq_ids)
        while request_id is None and str(seq_id) in self.requests:  # a caller chose this id for another request
            seq_id = next(self._seq_ids)
        return self.inputs.process(prompt, params, seq_id, str(seq_id) if request_id is None else request_id, lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (the server's ``--lora-modules`` and ``/v1/load_lora_adapter``);
        raises RequestError naming what does not fit."""
        with self.lock:
            if self.runner.lora is None:
                raise RequestError(f"adapter {lora_request.lora_name!r}: LoRA is off; start the engine with "
                                   "lora: {enabled: true}")
            self.runner.lora.load(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (its host copy and its slot); refused while a request for it waits or runs."""
        with self.lock:
            users = [s.request_id for s in self.requests.values() if s.lora is not None
                     and s.lora.lora_int_id == lora_int_id and not s.is_finished]
            if users:
                raise RequestError(f"adapter id {lora_int_id} is in use by {len(users)} request(s) "
                                   f"({', '.join(map(repr, users[:3]))}); unload it once they finish")
            slots = self.scheduler.lora_slots
            if slots is not None:
                slots.forget(lora_int_id)
            if self.runner.lora is not None:
                self.runner.lora.remove(lora_int_id)

    def queue_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by :meth:`make_sequence` (its request id must still be free)."""
        with self.lock:
            if self.closed:
                raise EngineClosedError("the engine was shut down; make a new one")
            if seq.request_id in self.requests:
                raise RequestError(f"request_id {seq.request_id!r} is already in use")
            self.requests[seq.request_id] = seq
            if seq.params.n > 1:  # the other samples are queued by the scheduler once this one's prompt is computed
                group = parallel_sampling.fork(seq, lambda: next(self._seq_ids))
                self._group_of.update((s.seq_id, group) for s in group.seqs)
                self.scheduler.add(seq, group.seqs[1:])
            else:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request (every sample of an ``n > 1`` one); its blocks are freed at once. Unknown or finished ids are ignored."""
        with self.lock:
            seq = self.requests.get(request_id)
            if seq is None:
                return
            if self.queue.in_flight is not None:  # its step ends first: it reads the blocks
                self.queue.collected += collect(self)
            group = self._group_of.get(seq.seq_id)
            live = [s for s in (group.seqs if group is not None else [seq]) if not s.is_finished]
            for s in live:
                self._end(s, "abort")
            if live:
                self._aborted.append(seq)

    def take_aborted(self) -> list[Sequence]:
        """The sequences :meth:`abort` ended since the last call (a step never returns them)."""
        with self.lock:
            out, self._aborted = self._aborted, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.queue.collected)

    # ---------------------------------------------------------------- step
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences (the groups of ``n > 1`` requests) that got a token or finished.

        A plugin raising inside the step ends the requests it was working on (finish_reason
        ``"error"``, ``error`` naming the plugin) and frees their blocks; the others go on.
        """
        with self.lock:
            if self.closed:
                raise EngineClosedError("the engine was shut down; make a new one")
            if self.async_scheduling:
                touched = step_async(self)
            else:
                touched = self._step() if self.runner.pipeline_depth == 1 else step_stages(self)
            return parallel_sampling.as_requests(touched, self._group_of) if self._group_of else touched

    def _step(self) -> list[Sequence]:  # (with asynchronous scheduling or pipeline stages: batch_queue.py)
        try:
            batch = self.scheduler.schedule()
        except SchedulingError as exc:
            return self.scheduling_failed(exc)
        if not batch:
            return self.unschedulable(batch)
        self.num_steps += 1
        try:
            result = self.runner.execute(batch, self.eos_token_ids)
        except Exception as exc:
            return self.step_failed(batch, exc)
        return self.update(batch, result)

    def update(self, batch: ScheduledBatch, result: StepResult) -> list[Sequence]:
        """Apply a step's result (the scheduler), then its outputs: logprobs and stop strings (only where a
        request of the step asks for them), the next drafts."""
        rows = self.scheduler.seqs_of(batch)
        seqs = [s for s in rows if s is not None]  # (None: finished since the batch was scheduled)
        lps = NO_LOGPROBS
        if result.logprobs is not None or result.prompt_logprobs:
            try:  # everything that can fail on malformed sampler output first, before any sequence changes
                lps = self.outputs.logprobs(rows, result)
            except Exception as exc:
                why = f"sampler '{self.runner.sampler_name}' returned malformed logprobs: {type(exc).__name__}: {exc}"
                return self._fail([s for s in seqs if not s.is_finished], why)
        if self.spec is not None:
            self.spec.record(batch, result)
        before = {s.seq_id: len(s.token_ids) for s in seqs if s.params.stop} if self.tokenizer is not None else {}
        touched, failed = self.scheduler.update_from_output(batch, result)
        if lps is not NO_LOGPROBS:
            self.outputs.add_logprobs(seqs, lps, failed)
        if before:  # requests with stop strings: the output tokens each got this step
            new = {s.seq_id: len(s.token_ids) - before[s.seq_id] for s in touched if s.seq_id in before}
            for seq, stop, keep in self.outputs.stop_strings(touched, new):
                seq.stop_reason = stop  # type: ignore[assignment]  # the string, as vLLM reports it
                self._end(seq, "stop", keep=keep)
        if failed or lps.non_finite:
            self._fail_rows(seqs, failed, lps.non_finite, touched)
        ended = [s.seq_id for s in seqs if s.status is FINISHED]
        if ended:
            self._released(ended)
        if batch.preempted_ids:
            self._released(batch.preempted_ids, ended=False)
        if self.spec is not None:
            self.scheduler.update_draft_token_ids(self.spec.propose(self.scheduler.running))
        return touched

    # ------------------------------------------------------------- failures
    def step_failed(self, batch: ScheduledBatch, exc: BaseException) -> list[Sequence]:
        """End only the step's requests: a plugin's StepError as it reads, anything else (a bug outside the plugins) logged too."""
        seqs = [s for s in self.scheduler.seqs_of(batch) if s is not None and not s.is_finished]
        if isinstance(exc, StepError):
            return self._fail(seqs, str(exc))
        logger.exception("step failed outside any plugin", exc_info=exc)
        return self._fail(seqs, f"step failed: {type(exc).__name__}: {exc}")

    def scheduling_failed(self, exc: SchedulingError) -> list[Sequence]:
        sc = self.scheduler
        culprits = [exc.seq] if exc.seq is not None else list(sc.running) + list(sc.waiting)[:1]
        culprits = [s for s in culprits if not s.is_finished]
        return self._fail(culprits, f"KV-cache manager '{self.runner.kv_manager_name}' failed while scheduling: {exc}")

    def unschedulable(self, batch: ScheduledBatch) -> list[Sequence]:
        """Nothing was scheduled: a request that can never be scheduled ends instead of spinning."""
        stuck = self.scheduler.stuck(batch)
        return [] if stuck is None else self._fail([stuck[0]], stuck[1])

    def _fail(self, seqs: list[Sequence], message: str) -> list[Sequence]:
        logger.error("step failed, %d request(s) end with an error: %s", len(seqs), message)
        for seq in seqs:
            seq.error = message
            self._end(seq, "error")
        return seqs

    def _fail_rows(self, seqs: list[Sequence], failed: dict[int, str], non_finite: dict[int, str], touched: list[Sequence]) -> None:
        """End the step's requests the KV-cache manager failed on, then those whose prompt logprobs were
        not finite (``touched`` gains them)."""
        for seq in (s for s in seqs if s.seq_id in failed):
            touched += self._fail([seq], f"KV-cache manager '{self.runner.kv_manager_name}' failed {failed[seq.seq_id]}")
        for seq in (s for s in seqs if s.seq_id in non_finite and s.seq_id not in failed and s.finish_reason != "error"):
            self._fail([seq], non_finite[seq.seq_id])  # (a chunk that sampled nothing: not touched yet)
            touched += [] if seq in touched else [seq]

    def _end(self, seq: Sequence, reason: str, keep: int | None = None) -> None:
        """End ``seq`` (the scheduler frees its blocks) and forget its drafts."""
        self.scheduler.finish(seq, reason, keep=keep)
        self._released([seq.seq_id])

    def _released(self, seq_ids: Any, ended: bool = True) -> None:
        """Forget what the logits processors (``ended``) and the proposer hold for ``seq_ids``."""
        ids = list(seq_ids)
        if ended:
            self.runner.release_requests(ids)
        if self.spec is not None:
            self.spec.release(ids)

    # --------------------------------------------------------------- switches
    def _require_idle(self, what: str) -> None:
        if self.scheduler.has_unfinished() or self.queue.in_flight is not None or self.queue.collected:
            raise RuntimeError(f"{what} can be switched only while no request is running")

    def set_async_scheduling(self, on: bool) -> None:
        """Switch asynchronous scheduling while no request runs (``corerun bench --async-scheduling both``)."""
        with self.lock:
            self._require_idle("asynchronous scheduling")
            if on:
                check_async_scheduling(self.config.model_copy(
                    update={"scheduler": self.config.scheduler.model_copy(update={"async_scheduling": True})}))
            self.async_scheduling = on

    def set_speculative(self, on: bool) -> None:
        """Propose drafts, or not, while no request runs (``corerun bench --speculative both`` compares
        the two on one engine); off, a step is exactly a non-speculative engine's.  On needs an engine
        built with ``speculative.method`` set."""
        with self.lock:
            self._require_idle("speculative decoding")
            if on and self.spec is None:
                raise RuntimeError("speculative decoding can be switched on only in an engine built with "
                                   "speculative.method set")
            if self.spec is not None:
                self.spec.enabled, self.scheduler.num_spec_tokens = on, on * self.spec.proposer.num_tokens

    # -------------------------------------------------------------- output
    def output(self, seq: Sequence | SequenceGroup) -> RequestOutput:
        """The request's output so far; for ``n > 1`` (a sequence of the request, or its group) every sample's."""
        group = seq if isinstance(seq, SequenceGroup) else self._group_of.get(seq.seq_id)
        return self.outputs.output(group if group is not None else seq)

    def release(self, request_id: str) -> None:
        """Forget a finished request (the engine keeps no history of its own)."""
        with self.lock:
            seq = self.requests.get(request_id)
            if seq is None:
                return
            group = self._group_of.get(seq.seq_id)
            seqs = group.seqs if group is not None else [seq]
            if all(s.is_finished for s in seqs):
                for s in seqs:
                    self._group_of.pop(s.seq_id, None)
                self.outputs.release([s.seq_id for s in seqs])
                del self.requests[request_id]

    def shutdown(self) -> None:
        """Release the KV cache and the graphs at once, and what the runner holds outside this process
        (tensor-parallel workers); the engine refuses work afterwards. Safe to call twice."""
        with self.lock:
            self.closed = True
            collect(self)
            self.queue.collected = []
            self.queue.shutdown()
            for rid in list(self.requests):
                self.abort(rid)
            self._aborted = []
            self.runner.shutdown()
            if self.spec is not None:  # the draft model's too
                self.spec.shutdown()

