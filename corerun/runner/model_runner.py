"""The ModelRunner: composes model, attention backend, KV cache, graph runner and sampler, and runs steps.

Everything it composes comes from the registry by the names in the config; nothing here knows which
backend, cache manager, graph runner or sampler it got.  Per step it prepares the inputs (token ids,
positions, slot mapping, block tables, query/sequence lengths, logits indices) in one host staging
buffer copied to the device once (:mod:`corerun.runner.step_inputs`), runs the model through the graph
runner, computes logits for the rows that need them, and samples.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corerun.capabilities import Need
from corerun.config import Config
from corerun.kv_cache.memory import check_kv_cache_fits
from corerun.core.batch import ScheduledBatch, StepResult
from corerun.errors import ConfigError, StepError
from corerun.forward_context import AttentionContext
from corerun.runner.profile import StepMemory
from corerun.logits_processing import LogitsProcessors
from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import GraphLimits, ModelInputs
from corerun.protocols.sampler import LogprobsTensors, SamplerOutput, SamplingMetadata
from corerun.registry import Registry, get_registry
from corerun.sdk.sampling import to_device
from corerun.sampling_params import SamplingParams
from corerun.runner.step_inputs import StepInputs
from corerun.threads import apply_threads

logger = logging.getLogger("corerun.runner")


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
    rows: np.ndarray  # sampled rows, indices into sched.seqs
    logits_indices: np.ndarray  # their rows of the step's hidden states
    seqs: list[Any]  # the sampled rows' sequences
    meta: SamplingMetadata | None  # their sampling metadata (None with drafts: built per verified position)
    eos_token_ids: frozenset[int]
    has_drafts: bool
    prompt_plan: list[tuple[int, int, int, int, Any]]  # requests owed prompt logprobs this step


@dataclass
class ExecuteModelState:
    """A step between :meth:`ModelRunner.execute_model` (the forward) and :meth:`ModelRunner.sample_tokens`."""

    step: PreparedStep
    hidden: torch.Tensor
    prompt_logprobs: dict[int, tuple[int, LogprobsTensors]]


class ModelRunner:
    # tp: this process's tensor-parallel group (corerun.executor); the model holds this rank's shard
    def __init__(self, config: Config, registry: Registry | None = None, tp: Any = None) -> None:
        from corerun.kv_cache.sizing import num_blocks_for_budget
        from corerun.models.loader import load_model

        self.config = config
        self.registry = registry or get_registry()
        self.registry.check_names(config)  # a wrong or duplicated name fails now, not after the model loads
        self.device = resolve_device(config.device)
        self.threads = apply_threads(config.threads, tp.world_size if tp is not None else 1)  # torch's intra-op pool
        # unseeded requests draw from torch's default generators: seeded here, a run repeats itself
        torch.manual_seed(config.seed)
        self.model_dir = Path(config.model) if config.model else self._default_model_dir()
        self.model, self.model_config = load_model(
            self.model_dir,
            dtype=lambda model_dtype: resolve_dtype(config.dtype, self.device, model_dtype),
            device=self.device,
            allow_pickle=config.allow_pickle_weights,
            tp=tp,
        )
        mc = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.vocab_size = mc.vocab_size
        self.block_size = config.kv_cache.block_size
        ml = config.scheduler.max_model_len
        self.max_model_len = mc.max_model_len if ml == "auto" else ml
        if self.max_model_len > mc.max_model_len:
            raise ConfigError(
                f"scheduler.max_model_len: {self.max_model_len} is longer than the model's "
                f"supported length {mc.max_model_len}"
            )

        # attention backend: the user's choice, or the best capable one for `auto`
        spec = self.model.attention_spec(self.dtype, self.block_size, self.device)
        select = self.registry.select  # explicit names as asked; `auto` by priority among what fits (registry.py)
        self.attention_name = select("attention", config.attention.name, spec).name
        self.attention = self.registry.create(
            "attention", self.attention_name, spec, options=config.attention.options
        )

        # graph runner and sampler are chosen first: the KV budget leaves room for what they need
        need = Need(self.device, attention=self.attention, tensor_parallel=tp is not None and tp.world_size > 1)
        graph_name = self.graph_name = select("graph", config.graph.runner.name, need, "graph.runner").name
        limits = GraphLimits(
            max_batch_size=min(config.graph.max_batch_size, config.scheduler.max_num_seqs),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            hidden_size=mc.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )
        self.sampler_name = select("sampler", config.sampler.name, need).name
        self.sampler = self.registry.create("sampler", self.sampler_name, self.vocab_size, self.device, options=config.sampler.options)
        # requests finished since the sampler was last called (SamplingMetadata.finished_seq_ids); read
        # and written by sample_tokens only, which runs one step at a time
        self._finished_for_sampler: set[int] = set()
        self.logits_processors = LogitsProcessors(  # between logits and sampler (corerun.logits_processing)
            self.registry, self.vocab_size, self.device, self.sampler_name, self.sampler.capabilities
        )

        # KV cache: blocks sized from the memory budget unless given
        per_block = self.attention.kv_cache_bytes_per_block() * mc.num_layers
        self.step_memory: StepMemory | None = None
        if config.kv_cache.num_blocks == "auto":
            if self._profiles_step_memory():
                self.step_memory = self._profile_step_memory(limits)
            self.num_blocks = num_blocks_for_budget(
                per_block,
                device=self.device,
                memory_fraction=config.kv_cache.memory_fraction,
                cpu_memory_gb=config.kv_cache.cpu_memory_gb,
                reserved_bytes=self.step_memory.reserved_bytes if self.step_memory else 0,
            )
        else:
            self.num_blocks = config.kv_cache.num_blocks
            check_kv_cache_fits(self.num_blocks, per_block, self.device)
        if tp is not None and tp.world_size > 1:  # every rank allocates (and the engine schedules into) the smallest count
            self.num_blocks = tp.min_int(self.num_blocks)
        self.kv_caches = [self.attention.allocate_kv_cache(self.num_blocks) for _ in range(mc.num_layers)]
        self.kv_manager_name = select("kv_cache", config.kv_cache.manager.name, need, "kv_cache.manager").name
        self.kv_manager = self.registry.create(
            "kv_cache", self.kv_manager_name, self.num_blocks, self.block_size,
            prefix_caching=config.kv_cache.prefix_caching, options=config.kv_cache.manager.options,
        )

        # graph runner around the composed model
        self.graph = self.registry.create(
            "graph", graph_name, _weak_model_fn(self), self.attention, limits, options=config.graph.runner.options
        )
        self.graph.capture()

        logger.info(
            "model %s (%s) on %s/%s: attention=%s kv_cache=%s (%d blocks of %d) graph=%s sampler=%s",
            self.model_dir, ",".join(mc.architectures), self.device, str(self.dtype).removeprefix("torch."),
            self.attention_name, self.kv_manager_name, self.num_blocks, self.block_size, graph_name, self.sampler_name,
        )

    # ------------------------------------------------------ memory profile
    def _profiles_step_memory(self) -> bool:
        """Only CUDA measures its step memory; elsewhere ``kv_cache.cpu_memory_gb`` is the KV budget itself."""
        return self.device.type == "cuda"

    @torch.no_grad()  # not inference mode: a sampler may keep buffers it makes here and write them later
    def _profile_step_memory(self, limits: GraphLimits) -> StepMemory:
        """Run the worst prefill, the widest eager decode, the widest sampling and (when graphs are
        captured) the largest captured decode once each on a one-block scratch cache, and measure their
        peaks (see :mod:`corerun.runner.profile`).  Every rank of a tensor-parallel group runs the
        same forwards in the same order; only the rank holding the logits samples."""
        from corerun.runner import profile

        sc, bs, dev = self.config.scheduler, self.block_size, self.device
        prefill = profile.worst_prefill(sc.max_num_batched_tokens, self.max_model_len, sc.max_num_seqs, bs, dev)
        decode_rows = min(sc.max_num_seqs, sc.max_num_batched_tokens)
        decode = profile.widest_decode(decode_rows, self.max_model_len, bs, dev)
        reg = self.registry.get("graph", self.graph_name)
        captures = bool(getattr(reg.capabilities, "captures", False)) and bool(
            getattr(self.attention.capabilities, "cuda_graph_decode", False)
        )
        captured = profile.captured_decode(limits) if captures else None
        rows = sc.max_num_seqs
        params, what = self._widest_sampling(rows)
        self.kv_caches = [self.attention.allocate_kv_cache(1).zero_() for _ in range(self.model_config.num_layers)]
        try:
            def forward(inputs: ModelInputs) -> torch.Tensor:
                return self._model_fn(inputs.input_ids, inputs.positions, self.attention.plan(inputs.batch))

            # (the first prefill also compiles / autotunes the backend's kernels: triton's autotuner
            # times candidates with a 256 MiB scratch buffer, which this peak then includes, and which
            # a later autotune for another tile shape needs again)
            prefill_bytes = profile.peak_bytes(lambda: forward(prefill), dev)
            decode_bytes = profile.peak_bytes(lambda: forward(decode), dev)
            hidden = torch.randn(rows, self.model_config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev, self.dtype)

            def sample() -> None:
                # a real step still holds its hidden states [num_tokens, hidden] while it samples
                held = torch.empty(prefill.batch.num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=dev)
                logits = self.model.compute_logits(hidden)
                if logits is not None:  # tensor parallel: the rank holding the logits samples
                    prompts = [list(range(1, 9))] * rows
                    self.sampler.sample(logits, SamplingMetadata(params, prompts, [[1, 2]] * rows))
                del held  # (only now: it was part of the peak)

            sampling_bytes = profile.peak_bytes(sample, dev)
            graph_bytes = profile.peak_bytes(lambda: forward(captured), dev) if captured is not None else 0
        finally:
            self.kv_caches = []
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        memory = profile.StepMemory(
            prefill_bytes, decode_bytes, sampling_bytes, graph_bytes,
            prefill.batch.num_tokens, prefill.batch.num_reqs, decode_rows,
        )
        mib = 2.0**20
        logger.info(
            "kv_cache: step memory kept out of the KV budget: %.1f MiB (prefill of %d tokens in %d requests at "
            "max_model_len %d: %.1f MiB; eager decode of %d: %.1f MiB; sampling %d rows %s: %.1f MiB; captured "
            "decode of %d: %.1f MiB)",
            memory.reserved_bytes / mib, memory.prefill_tokens, memory.prefill_requests, self.max_model_len,
            prefill_bytes / mib, decode_rows, decode_bytes / mib, rows, what, sampling_bytes / mib,
            limits.max_batch_size if captures else 0, graph_bytes / mib,
        )
        return memory

    def _widest_sampling(self, rows: int) -> tuple[list[SamplingParams], str]:
        """Parameters for ``rows`` rows that take every path the sampler accepts: greedy rows mixed
        with rows using all its other parameters (seeded, truncated, penalised, with logprobs)."""
        everything = SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
            presence_penalty=0.2, seed=1, logprobs=min(self.config.max_logprobs, 20) or None, logit_bias={0: 1.0},
        )
        for rich, what in ((everything, "with every parameter"), (SamplingParams(temperature=0.8, seed=1), "temperature, seed")):
            try:
                self.sampler.check(rich)
            except Exception:
                continue
            return [SamplingParams(temperature=0.0) if i % 2 else rich for i in range(rows)], what
        return [SamplingParams()] * rows, "defaults"

    @staticmethod
    def _default_model_dir() -> Path:
        from corerun.models.default import default_model_dir

        return default_model_dir()

    def _model_fn(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, AttentionContext(self.attention, metadata, self.kv_caches))

    # the two seams tensor-parallel rank 0 (corerun.executor.driver) extends to bring its workers along
    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The step's hidden states ``[num_tokens, hidden_size]``."""
        return self.graph.run(inputs)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab_size]`` of the hidden rows ``[N, hidden_size]``."""
        return self.model.compute_logits(hidden)

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
            max_num_tokens=sc.max_num_batched_tokens,
            max_num_reqs=sc.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
        )

    def prepare_inputs(self, sched: ScheduledBatch) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """Flatten a scheduled batch (see :class:`corerun.runner.step_inputs.StepInputs`).

        Returns the model inputs, the sampled rows (int64 ``[S]``, indices into ``sched.seqs``) and
        their logits indices (int64 ``[S]``, rows of the step's hidden states).
        """
        return self.step_inputs.build(sched, self.kv_manager.block_table)

    # ----------------------------------------------------------------- step
    def execute(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> StepResult:
        """Run one step: :meth:`prepare_step`, :meth:`execute_model`, :meth:`sample_tokens` in a row.
        Raises StepError naming the component that failed."""
        return self.sample_tokens(self.execute_model(self.prepare_step(sched, eos_token_ids)))

    def prepare_step(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> PreparedStep:
        """The step's host work: inputs copied to the device, the sampled rows and their metadata.

        Reads the sequences, the scheduler's and the KV-cache manager's state, so it runs on the thread
        that schedules; what follows (:meth:`execute_model`, :meth:`sample_tokens`) reads only what it
        returns and may run on another thread while the next step is scheduled.
        """
        extended = [(s, len(s.token_ids)) for s in sched.seqs if s.seq_id in sched.drafts]
        try:
            for s, _ in extended:  # the drafts are inputs of this step only
                s.token_ids.extend(sched.drafts[s.seq_id])
            inputs, rows, logits_indices = self.prepare_inputs(sched)
        except Exception as exc:
            raise StepError(
                f"preparing the step's inputs failed (block tables from KV-cache manager '{self.kv_manager_name}'): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            for s, n in extended:
                del s.token_ids[n:]
        seqs = [sched.seqs[i] for i in rows.tolist()]
        meta = None
        if seqs and not extended:
            meta = SamplingMetadata(
                params=[s.params for s in seqs],
                prompt_token_ids=[s.prompt_token_ids for s in seqs],
                output_token_ids=[s.output_view() for s in seqs],
                eos_token_ids=eos_token_ids,
                seq_ids=[s.seq_id for s in seqs],
            )
        return PreparedStep(
            sched, inputs, rows, logits_indices, seqs, meta, eos_token_ids, bool(extended),
            self._prompt_logprob_plan(sched, inputs),
        )

    def execute_model(self, step: PreparedStep) -> ExecuteModelState:
        """The forward (launched on the device; on CPU it runs here) and the prompt logprobs it owes."""
        try:
            hidden = self._forward(step.inputs)
        except Exception as exc:
            raise StepError(
                f"model forward failed (attention backend '{self.attention_name}', graph runner '{self.graph_name}'): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return ExecuteModelState(step, hidden, self._prompt_logprobs(step.prompt_plan, hidden))

    def sample_tokens(self, state: ExecuteModelState) -> StepResult:
        """Logits of the sampled rows, the logits processors, the sampler and the step's one host sync."""
        step, hidden, prompt_lp = state.step, state.hidden, state.prompt_logprobs
        rows, logits_indices, seqs = step.rows, step.logits_indices, step.seqs
        self._finished_for_sampler.update(step.sched.finished_ids)  # (told at the next call that samples)
        if len(rows) == 0:
            return StepResult([], [], None, prompt_lp)
        if step.has_drafts:
            return self._execute_drafts(step.sched, seqs, rows, logits_indices, hidden, step.eos_token_ids, prompt_lp)
        logits = self._compute_logits(self._sampled_hidden(hidden, step.inputs.batch, logits_indices))
        out, sampled, ended = self._sample(logits, step.meta, seqs)  # type: ignore[arg-type]
        row_ids = rows.tolist()
        return StepResult(sampled, row_ids, out.logprobs, prompt_lp, {row_ids[j]: why for j, why in ended.items()})

    def _execute_drafts(
        self, sched: ScheduledBatch, seqs: list[Any], rows: np.ndarray, logits_indices: np.ndarray,
        hidden: torch.Tensor, eos_token_ids: frozenset[int], prompt_lp: dict[int, tuple[int, LogprobsTensors]],
    ) -> StepResult:
        """Sample a step whose decodes carry drafts: one logits row per verified position (corerun.spec_decode).

        Rows of requests with drafts come ``1 + k`` per request, each with its own history; a logits
        processor or logprobs request never has drafts (the engine proposes none for it), so its
        single row is where it would be without speculation.
        """
        from corerun.spec_decode import accept_drafts, expand_metadata

        drafts = [sched.drafts.get(s.seq_id, []) for s in seqs]
        index = np.concatenate([np.arange(i - len(d), i + 1) for i, d in zip(logits_indices.tolist(), drafts)])
        first = np.cumsum([0] + [len(d) + 1 for d in drafts])[:-1]  # each request's first row
        logits = self._compute_logits(hidden[self._device_index(index)])
        meta = expand_metadata(seqs, drafts, eos_token_ids)  # (its finished_seq_ids: _sample adds them)
        owner = [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
        out, targets, ended = self._sample(logits, meta, owner)
        emitted = accept_drafts(targets, drafts)
        logprobs = out.logprobs
        if logprobs is not None:  # each request's first row (requests asking for logprobs have no drafts)
            at = torch.from_numpy(first).to(logprobs.token_ids.device)
            logprobs = LogprobsTensors(logprobs.token_ids[at], logprobs.logprobs[at], logprobs.ranks[at])
        row_ids = rows.tolist()
        row_of = {int(f): row_ids[j] for j, f in enumerate(first)}
        return StepResult(
            [e[0] for e in emitted], row_ids, logprobs, prompt_lp,
            {row_of[r]: why for r, why in ended.items() if r in row_of},
            {row_ids[j]: e[1:] for j, e in enumerate(emitted) if len(e) > 1},
        )

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, owners: list[Any]) -> tuple[SamplerOutput, list[int], dict[int, str]]:
        """The logits processors, the sampler and the step's one host sync, then the processors take
        the sampled tokens. ``owners[i]`` is the sequence of logits row ``i``. Returns the sampler's
        output, the sampled ids and the rows a processor ended (row -> reason)."""
        try:
            masked = self.logits_processors.apply(logits, owners)
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
        self._check_sampled(out.sampled_token_ids, sampled, len(owners))
        try:
            ended = self.logits_processors.accept(masked, sampled) if masked else {}
        except Exception as exc:
            raise StepError(f"logits processor failed taking the sampled tokens: {type(exc).__name__}: {exc}") from exc
        return out, sampled, ended

    def _sampled_hidden(self, hidden: torch.Tensor, batch: AttentionBatch, logits_indices: np.ndarray) -> torch.Tensor:
        """The hidden rows to sample from, without a host sync or a per-step copy where it can:

        - every token sampled (a decode step): ``hidden`` as it is;
        - every request sampled (whole prefills, with or without decodes): each request's last token,
          indexed by the step's device ``query_start_loc``, already on the device;
        - otherwise (a prefill chunk that does not end its prompt): a gather whose indices go through
          pinned memory on CUDA (a blocking copy from pageable memory would wait for the whole forward).
        """
        if len(logits_indices) == hidden.shape[0]:  # increasing indices below num_tokens: all of them
            return hidden
        if len(logits_indices) == batch.num_reqs:
            return hidden[batch.query_start_loc[1:].long() - 1]
        return hidden[self._device_index(logits_indices)]

    def _device_index(self, index: np.ndarray) -> torch.Tensor:
        """Row indices on the device, through pinned memory on CUDA (a copy from pageable memory would
        wait for the whole forward before the gather could be queued)."""
        t = torch.from_numpy(index)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _check_sampled(self, tokens: torch.Tensor, sampled: Any, batch_size: int) -> None:
        """A sampler's tokens must be int ``[batch_size]`` inside the vocabulary, or nothing is appended."""
        problem = ""
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            problem = f"dtype {tokens.dtype}"
        elif tokens.dim() != 1 or tokens.shape[0] != batch_size:
            problem = f"shape {list(tokens.shape)}"
        else:
            bad = [t for t in sampled if not 0 <= t < self.vocab_size]
            if bad:
                problem = f"token ids outside the vocabulary: {bad[:8]}"
        if problem:
            raise StepError(
                f"sampler '{self.sampler_name}' returned {problem}; expected integer token ids "
                f"[{batch_size}] in [0, {self.vocab_size})"
            )

    def _prompt_logprob_plan(self, sched: ScheduledBatch, inputs: ModelInputs) -> list[tuple[int, int, int, int, Any]]:
        """``(row, first target position, first hidden row, last hidden row, sequence)`` per request whose
        prompt logprobs this step computes (read now: the sequence may be preempted while the step runs)."""
        plan: list[tuple[int, int, int, int, Any]] = []
        wanted = [i for i, seq in enumerate(sched.seqs) if seq.wants_prompt_logprobs]
        if not wanted:  # the usual step: no host work beyond this scan
            return plan
        qsl = inputs.batch.query_start_loc_cpu.tolist()  # type: ignore[union-attr]
        for i in wanted:
            seq = sched.seqs[i]
            start = seq.num_computed_tokens  # position of the first token computed this step
            # hidden at position p predicts prompt token p + 1
            first = max(start, len(seq.prompt_logprobs or []) - 1)
            last = min(start + sched.num_new[i], seq.num_prompt_tokens - 1)
            if last > first:
                plan.append((i, first, qsl[i] + first - start, qsl[i] + last - start, seq))
        return plan

    def _prompt_logprobs(self, plan: list[tuple[int, int, int, int, Any]], hidden: torch.Tensor) -> dict[int, tuple[int, LogprobsTensors]]:
        """Logprobs of prompt tokens scheduled in this step, for requests that asked for them."""
        result: dict[int, tuple[int, LogprobsTensors]] = {}
        for i, first, lo, hi, seq in plan:
            targets = to_device(seq.prompt_token_ids[first + 1 : first + 1 + hi - lo], torch.int64, self.device)
            logits = self._compute_logits(hidden[lo:hi])  # the rows are contiguous: a view, no gather
            try:
                lp = self.sampler.prompt_logprobs(logits, targets, seq.params.prompt_logprobs or 0)
            except Exception as exc:
                raise StepError(
                    f"sampler '{self.sampler_name}' failed computing prompt logprobs: {type(exc).__name__}: {exc}"
                ) from exc
            result[i] = (first + 1, lp)
        return result


def _weak_model_fn(runner: ModelRunner) -> Any:
    """``runner._model_fn`` without a reference to ``runner``: the graph runner keeps this, and a bound
    method would make a cycle that holds the KV cache and graph pool until a full garbage collection."""
    ref = weakref.ref(runner)

    def model_fn(input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        return ref()._model_fn(input_ids, positions, metadata)  # type: ignore[union-attr]

    return model_fn
