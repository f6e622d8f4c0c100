"""The ModelRunner: composes model, attention backend, KV cache, graph runner and sampler, and runs steps.

Everything it composes comes from the registry by the names in the config; nothing here knows which
backend, cache manager, graph runner or sampler it got.  Per step it prepares the inputs (token ids,
positions, slot mapping, block tables, query/sequence lengths, logits indices) in one host staging
buffer copied to the device once (:mod:`corerun.runner.step_inputs`), runs the model through the graph
runner, computes logits for the rows that need them, and samples.

It reads no live object of the layers above: each step's :class:`ScheduledBatch` is a message of plain
values that the runner applies to its persistent batch (:mod:`corerun.runner.input_batch`), and the
step's inputs and sampling metadata are read from that batch alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from corerun.config import Config
from corerun.core.batch import ScheduledBatch, StepResult
from corerun.errors import ConfigError, StepError
from corerun.platform.host import AUTO_PARALLEL_TOKENS
from corerun.protocols.forward_context import AttentionContext, wants_layer
from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import ModelInputs
from corerun.protocols.sampler import NON_FINITE, LogprobsTensors, SamplerOutput, SamplingMetadata
from corerun.plugin.registry import Registry, get_registry
from corerun.runner.input_batch import InputBatch
from corerun.runner.pooling import Pooler, PoolPlan
from corerun.runner.step_inputs import StepInputs
from corerun.sampler.common import to_device

logger = logging.getLogger("corerun.runner")
NON_FINITE_ERROR = ("the logits of this request were not finite (NaN, +inf, or -inf for every token): the model, "
                    "a logits processor or the dtype's range produced them")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for, but torch.cuda.is_available() is False; use device: cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_dtype: torch.dtype | None) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32  # half-precision matmuls on CPU are slow and less exact
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass
class PreparedStep:
    """One step's host side (:meth:`ModelRunner.prepare_step`): what its forward and sampling read."""

    sched: ScheduledBatch
    inputs: ModelInputs
    rows: np.ndarray  # sampled rows, indices into sched.req_ids
    logits_indices: np.ndarray  # their rows of the step's hidden states
    batch_rows: list[int]  # the sampled rows' rows of the persistent batch
    seqs: list[Any]  # the sampled rows as the sampling side reads them (InputBatch.view)
    meta: SamplingMetadata | None  # their sampling metadata (None with drafts: built per verified position)
    eos_token_ids: frozenset[int]
    has_drafts: bool
    prompt_plan: list[tuple[int, int, int, int, Any]]  # requests owed prompt logprobs this step
    pool_plan: PoolPlan | None = None  # embedding requests in this step (corerun.runner.pooling)


@dataclass
class ExecuteModelState:
    """A step between :meth:`ModelRunner.execute_model` (the forward) and :meth:`ModelRunner.sample_tokens`."""

    step: PreparedStep
    hidden: torch.Tensor
    prompt_logprobs: dict[int, tuple[int, LogprobsTensors]]


class ModelRunner:
    """Built by :mod:`corerun.runner.construction`; ``tp``: this process's tensor-parallel group
    (corerun.executor), the model then holding this rank's shard."""

    lora: Any = None  # the adapters' slots and layers with lora.enabled (corerun.lora.manager.LoRAManager)
    graph_passthrough = False  # the graph runner declares passthrough: _forward plans and calls the model itself

    parallel_tokens = AUTO_PARALLEL_TOKENS  # from this many tokens a step runs on step_pools[1] (host.parallel_tokens)
    pipeline_depth = 1  # micro-batches in flight (corerun.executor.stage: one per pipeline stage; launch / collect)

    def __init__(self, config: Config, registry: Registry | None = None, tp: Any = None) -> None:
        from corerun.runner.construction import build

        self.config = config
        self.registry = registry or get_registry()
        build(self, tp)  # load -> select -> profile -> size -> allocate -> capture (corerun.runner.construction)

    def _model_fn(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions,
                          AttentionContext(self.attention, metadata, self.kv_caches, self.attention_per_layer))

    @cached_property
    def attention_per_layer(self) -> bool:
        """The backend is told each layer (some layer has a sliding window): read once, not per layer."""
        return wants_layer(self.attention)

    # the two seams tensor-parallel rank 0 (corerun.executor.driver) extends to bring its workers along
    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The step's hidden states ``[num_tokens, hidden_size]``; a passthrough graph runner (``eager``)
        would only plan and call the model, so the runner does that itself."""
        if not self.graph_passthrough:
            return self.graph.run(inputs)
        self.graph.stats.eager_steps += 1  # the runner's own count, kept as if it had run the step
        with torch.no_grad():
            return self._model_fn(inputs.input_ids, inputs.positions, self.attention.plan(inputs.batch))

    def _compute_logits(self, hidden: torch.Tensor, rows: slice | np.ndarray, batch: AttentionBatch) -> torch.Tensor:
        """float32 logits ``[N, vocab_size]`` of rows ``rows`` of the step's hidden states (:meth:`hidden_rows`)."""
        return self.model.compute_logits(self.hidden_rows(hidden, rows, batch))

    def set_vocabulary(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        """The engine's tokenizer and end-of-sequence ids, which structured-output processors read."""
        self.logits_processors.tokenizer, self.logits_processors.eos_token_ids = tokenizer, eos_token_ids

    def release_requests(self, seq_ids: Any) -> None:
        """Requests that ended (finished, aborted): the logits processors' state for them goes."""
        for sid in seq_ids:
            self.logits_processors.remove(sid)

    def shutdown(self) -> None:
        """Drop the KV cache and the graphs at once (the runner takes no step afterwards)."""
        self.kv_caches = []
        self.graph = None

    def describe(self) -> dict[str, str]:
        return {
            "attention": self.attention_name,
            "fused_ops": self.fused_ops_name,
            "kv_cache": self.kv_manager_name,
            "graph": self.graph_name,
            "sampler": self.sampler_name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    # --------------------------------------------------------------- inputs
    @cached_property
    def step_inputs(self) -> StepInputs:
        """The step-input builder and its staging buffer, sized from the scheduler's limits (made on first use)."""
        sc = self.config.scheduler
        return StepInputs(
            self.block_size,
            self.device,
            max_num_tokens=self.max_num_batched_tokens,
            max_num_reqs=sc.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            in_flight=self.pipeline_depth,  # (steps still reading their inputs while the next is built)
        )

    @cached_property
    def input_batch(self) -> InputBatch:
        """The live requests' persistent state, changed only by applying each step's batch."""
        return InputBatch(self.block_size)

    @cached_property
    def pooler(self) -> Pooler:
        """Embedding requests' pooling, with the partial sums it keeps between their chunks."""
        return Pooler()

    def prepare_inputs(self, sched: ScheduledBatch) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """Apply a scheduled batch to the persistent batch and flatten it (see
        :class:`corerun.runner.step_inputs.StepInputs`); its drafts are written after each row's last token.

        Returns the model inputs, the sampled rows (int64 ``[S]``, indices into ``sched.req_ids``) and
        their logits indices (int64 ``[S]``, rows of the step's hidden states).
        """
        ib = self.input_batch
        rows = ib.apply(sched)
        for sid, d in sched.drafts.items():
            ib.write_drafts(ib.index[sid], d)
        return self.step_inputs.build(sched, ib, rows)

    # ----------------------------------------------------------------- step
    def execute(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> StepResult:
        """Run one step: :meth:`prepare_step`, :meth:`execute_model`, :meth:`sample_tokens` in a row.
        Raises StepError naming the component that failed."""
        return self.sample_tokens(self.execute_model(self.prepare_step(sched, eos_token_ids)))

    def prepare_step(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> PreparedStep:
        """The step's host work: inputs copied to the device, the sampled rows and their metadata.

        Applies ``sched`` to the persistent batch; what follows (:meth:`execute_model`,
        :meth:`sample_tokens`) reads only what it returns and the rows it names, and may run on another
        thread while the next step is scheduled.
        """
        ib, procs = self.input_batch, self.logits_processors
        if sched.new_reqs:
            procs.add_requests(sched.new_reqs)
        pooling = bool(ib.pooling_ids)  # (read before the batch applies: embedding requests leaving in it are told to the pooler)
        try:
            inputs, rows, logits_indices = self.prepare_inputs(sched)
        except Exception as exc:
            raise StepError(
                f"preparing the step's inputs failed (block tables from KV-cache manager '{self.kv_manager_name}'): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        pool_plan = None
        if pooling or ib.pooling_ids:  # embedding requests are pooled, not sampled
            pool_plan, rows, logits_indices = self._pool_plan(sched, rows, logits_indices)
        batch_rows = [ib.index[sched.req_ids[i]] for i in rows.tolist()]
        seqs = [ib.view(r) for r in batch_rows]
        has_drafts = bool(sched.drafts)
        meta = None
        if seqs and not has_drafts:
            meta = SamplingMetadata(
                params=[s.params for s in seqs],
                prompt_token_ids=[s.prompt_token_ids for s in seqs],
                output_token_ids=[s.output_view() for s in seqs],
                eos_token_ids=eos_token_ids,
                seq_ids=[s.seq_id for s in seqs],
            )
        return PreparedStep(
            sched, inputs, rows, logits_indices, batch_rows, seqs, meta, eos_token_ids, has_drafts,
            self._prompt_logprob_plan(sched, inputs) if ib.prompt_logprob_ids else [], pool_plan,
        )

    def step_threads(self, num_tokens: int) -> int:
        """The threads a step of ``num_tokens`` tokens runs on (``threads: auto`` runs a small step on one)."""
        return self.step_pools[num_tokens >= self.parallel_tokens]

    def execute_model(self, step: PreparedStep) -> ExecuteModelState:
        """The forward (launched on the device; on CPU it runs here) and the prompt logprobs it owes."""
        threads = self.step_threads(step.sched.num_tokens)
        if torch.get_num_threads() != threads:  # (OpenMP keeps the count per thread: the one running the forward sets it)
            torch.set_num_threads(threads)
        try:
            if self.lora is not None:  # the new requests' adapters in their slots, the tokens' slots in place
                self.lora.begin_step(step.sched.new_reqs, step.inputs.lora_slots)
            hidden = self._forward(step.inputs)
        except Exception as exc:
            raise StepError(
                f"model forward failed (attention backend '{self.attention_name}', graph runner '{self.graph_name}'): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        prompt_lp = self._prompt_logprobs(step.prompt_plan, hidden, step.inputs.batch) if step.prompt_plan else {}
        return ExecuteModelState(step, hidden, prompt_lp)

    def sample_tokens(self, state: ExecuteModelState) -> StepResult:
        """Logits of the sampled rows, the logits processors, the sampler and the step's one host sync."""
        step, hidden, prompt_lp = state.step, state.hidden, state.prompt_logprobs
        rows, logits_indices, seqs = step.rows, step.logits_indices, step.seqs
        self._finished_for_sampler.update(step.sched.finished_ids)  # (told at the next call that samples)
        pooled = self._pool(step.pool_plan, hidden) if step.pool_plan is not None else {}
        if len(rows) == 0:
            return StepResult([], [], None, prompt_lp, pooled=pooled)
        if step.has_drafts:
            result = self._execute_drafts(step, hidden, prompt_lp)
        else:
            logits = self._compute_logits(hidden, logits_indices, step.inputs.batch)
            out, sampled, ended = self._sample(logits, step.meta, seqs)  # type: ignore[arg-type]
            row_ids = rows.tolist()
            result = StepResult(sampled, row_ids, out.logprobs, prompt_lp, {row_ids[j]: why for j, why in ended.items()})
        result.pooled = pooled
        record = self.input_batch.record  # the sampled tokens stand in until the next batch states them
        for j, r in enumerate(step.batch_rows):
            record(r, result.emitted(j))
        return result

    def _pool_plan(self, sched: ScheduledBatch, rows: np.ndarray, logits_indices: np.ndarray) -> tuple[PoolPlan | None, np.ndarray, np.ndarray]:
        """A step with embedding requests (or some leaving: the pooler drops their partial sums): the
        pooler's plan (None: nothing to pool), and the sampled rows and their logits indices without the rows it pools."""
        plan = self.pooler.plan(sched, self.input_batch, np.cumsum((0, *sched.num_scheduled)).tolist())
        if plan is not None and plan.rows:
            pooled = {p.row for p in plan.rows}
            keep = np.fromiter((i not in pooled for i in rows.tolist()), dtype=bool, count=len(rows))
            rows, logits_indices = rows[keep], logits_indices[keep]
        return plan, rows, logits_indices

    def _pool(self, plan: PoolPlan, hidden: torch.Tensor) -> dict[int, list[float]]:
        """The embedding requests' pooled vectors (row -> vector) from the step's hidden states."""
        try:
            return self.pooler.pool(plan, hidden)
        except Exception as exc:
            raise StepError(f"pooling the embedding requests' hidden states failed: {type(exc).__name__}: {exc}") from exc

    def _execute_drafts(self, step: PreparedStep, hidden: torch.Tensor, prompt_lp: dict[int, tuple[int, LogprobsTensors]]) -> StepResult:
        """Sample a step whose decodes carry drafts: one logits row per verified position (corerun.spec_decode).

        Rows of requests with drafts come ``1 + k`` per request, each with its own history; a logits
        processor or logprobs request never has drafts (the engine proposes none for it), so its
        single row is where it would be without speculation.
        """
        from corerun.spec_decode import accept_drafts, expand_metadata

        sched, seqs, rows, eos_token_ids = step.sched, step.seqs, step.rows, step.eos_token_ids
        drafts = [sched.drafts.get(s.seq_id, ()) for s in seqs]
        index = np.concatenate([np.arange(i - len(d), i + 1) for i, d in zip(step.logits_indices.tolist(), drafts)])
        first = np.cumsum([0] + [len(d) + 1 for d in drafts])[:-1]  # each request's first row
        logits = self._compute_logits(hidden, index, step.inputs.batch)
        meta = expand_metadata(seqs, drafts, eos_token_ids)  # (its finished_seq_ids: _sample adds them)
        owner = [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
        out, targets, ended = self._sample(logits, meta, owner)
        emitted = accept_drafts(targets, drafts)
        logprobs = out.logprobs
        if logprobs is not None:  # each request's first row (requests asking for logprobs have no drafts)
            at = torch.from_numpy(first).to(logprobs.token_ids.device)
            logprobs = LogprobsTensors(logprobs.token_ids[at], logprobs.logprobs[at], logprobs.ranks[at])
        row_ids = rows.tolist()
        request_of = np.repeat(row_ids, [len(d) + 1 for d in drafts])  # logits row -> its request's row
        return StepResult(
            [e[0] for e in emitted], row_ids, logprobs, prompt_lp,
            {int(request_of[r]): why for r, why in ended.items()},
            {row_ids[j]: e[1:] for j, e in enumerate(emitted) if len(e) > 1},
        )

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, owners: list[Any]) -> tuple[SamplerOutput, list[int], dict[int, str]]:
        """The logits processors, the sampler and the step's one host sync, then the processors take
        the sampled tokens. ``owners[i]`` is the sequence of logits row ``i``. Returns the sampler's
        output, the sampled ids and the rows that end (row -> reason): a processor ended them, or their
        logits were not finite (then no processor takes their token)."""
        procs = self.logits_processors
        try:
            masked = procs.apply(logits, owners) if procs.in_use else None
        except Exception as exc:
            raise StepError(f"logits processor failed: {type(exc).__name__}: {exc}") from exc
        if self._finished_for_sampler:
            meta = replace(meta, finished_seq_ids=frozenset(self._finished_for_sampler))
            self._finished_for_sampler.clear()
        try:
            out: SamplerOutput = self.sampler.sample(logits, meta)
            sampled = out.sampled_token_ids.tolist()  # the step's one host sync
        except Exception as exc:
            raise StepError(f"sampler '{self.sampler_name}' failed: {type(exc).__name__}: {exc}") from exc
        non_finite = self._check_sampled(out.sampled_token_ids, sampled, len(owners))
        if masked:
            masked.failed.update(non_finite)
        try:
            ended = procs.accept(masked, sampled) if masked else {}
        except Exception as exc:
            raise StepError(f"logits processor failed taking the sampled tokens: {type(exc).__name__}: {exc}") from exc
        return out, sampled, {**ended, **non_finite}

    def hidden_rows(self, hidden: torch.Tensor, rows: slice | np.ndarray, batch: AttentionBatch) -> torch.Tensor:
        """Rows ``rows`` (a slice, or increasing int64 indices) of the step's hidden states ``[num_tokens,
        hidden_size]``, without a host sync or a per-step copy where it can:

        - a slice (prompt logprobs' contiguous rows): a view;
        - every token (a decode step): ``hidden`` as it is;
        - one row per request (whole prefills, with or without decodes): each request's last token,
          indexed by the step's device ``query_start_loc``, already on the device;
        - otherwise (a prefill chunk that does not end its prompt, verified drafts): a gather whose
          indices go through pinned memory on CUDA (a blocking copy from pageable memory would wait
          for the whole forward).

        Tensor-parallel workers select their rows with it too, from the same step's ``rows``.
        """
        if isinstance(rows, slice):
            return hidden[rows]
        if len(rows) == hidden.shape[0]:  # increasing indices below num_tokens: all of them
            return hidden
        if len(rows) == batch.num_reqs and _each_last(rows, batch):
            return hidden[batch.query_start_loc[1:].long() - 1]
        return hidden[self._device_index(rows)]

    def _device_index(self, index: np.ndarray) -> torch.Tensor:
        """Row indices on the device, through pinned memory on CUDA (a copy from pageable memory would
        wait for the whole forward before the gather could be queued)."""
        t = torch.from_numpy(index)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _check_sampled(self, tokens: torch.Tensor, sampled: Any, batch_size: int) -> dict[int, str]:
        """A sampler's tokens must be int ``[batch_size]`` inside the vocabulary, or nothing is appended;
        returns the rows it marked ``NON_FINITE`` (row -> the error their requests end with)."""
        problem = ""
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            problem = f"dtype {tokens.dtype}"
        elif tokens.dim() != 1 or tokens.shape[0] != batch_size:
            problem = f"shape {list(tokens.shape)}"
        else:
            bad = [t for t in sampled if not 0 <= t < self.vocab_size and t != NON_FINITE]
            if bad:
                problem = f"token ids outside the vocabulary: {bad[:8]}"
        if problem:
            raise StepError(
                f"sampler '{self.sampler_name}' returned {problem}; expected integer token ids "
                f"[{batch_size}] in [0, {self.vocab_size})"
            )
        return {i: NON_FINITE_ERROR for i, t in enumerate(sampled) if t == NON_FINITE} if NON_FINITE in sampled else {}

    def _prompt_logprob_plan(self, sched: ScheduledBatch, inputs: ModelInputs) -> list[tuple[int, int, int, int, Any]]:
        """``(row, first target position, first hidden row, last hidden row, (prompt ids, count))`` per
        request whose prompt logprobs this step computes (read now, from the persistent batch)."""
        plan: list[tuple[int, int, int, int, Any]] = []
        ib = self.input_batch
        wanted = []
        for i, sid in enumerate(sched.req_ids):
            r = ib.index[sid]
            p = ib.params[r]
            if p is not None and p.prompt_logprobs is not None and ib.num_computed[r] < ib.num_prompt[r] - 1:
                wanted.append((i, r, p))
        if not wanted:  # the usual step: no host work beyond this scan
            return plan
        qsl = inputs.batch.query_start_loc_cpu.tolist()  # type: ignore[union-attr]
        for i, r, p in wanted:
            start = int(ib.num_computed[r])  # position of the first token computed this step
            num_prompt = int(ib.num_prompt[r])
            # hidden at position p predicts prompt token p + 1
            first = max(start, int(ib.prompt_logprobs_from[r]))
            last = min(start + sched.num_scheduled[i], num_prompt - 1)
            if last > first:
                targets = ib.token_ids[r, first + 1 : last + 1].tolist()
                plan.append((i, first, qsl[i] + first - start, qsl[i] + last - start, (targets, p.prompt_logprobs or 0)))
        return plan

    def _prompt_logprobs(
        self, plan: list[tuple[int, int, int, int, Any]], hidden: torch.Tensor, batch: AttentionBatch,
    ) -> dict[int, tuple[int, LogprobsTensors]]:
        """Logprobs of prompt tokens scheduled in this step, for requests that asked for them."""
        result: dict[int, tuple[int, LogprobsTensors]] = {}
        for i, first, lo, hi, (target_ids, num_logprobs) in plan:
            targets = to_device(target_ids, torch.int64, self.device)
            logits = self._compute_logits(hidden, slice(lo, hi), batch)  # contiguous rows: a view, no gather
            try:
                lp = self.sampler.prompt_logprobs(logits, targets, num_logprobs)
            except Exception as exc:
                raise StepError(
                    f"sampler '{self.sampler_name}' failed computing prompt logprobs: {type(exc).__name__}: {exc}"
                ) from exc
            result[i] = (first + 1, lp)
        return result


def _each_last(rows: np.ndarray, batch: AttentionBatch) -> bool:
    """``rows`` are every request's last token (read from the host copy of ``query_start_loc``)."""
    qsl = batch.query_start_loc_cpu
    return qsl is not None and bool(np.array_equal(rows, qsl[1:].numpy() - 1))
