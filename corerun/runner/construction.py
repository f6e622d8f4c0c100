"""A ModelRunner's construction, in order: load -> select -> profile -> size -> allocate -> capture -> warm up.

Each stage reads the configuration and what the stages before it set on the runner:

- load:     the model's weights and config on the device, the runner's dtype and lengths
- select:   attention backend, graph runner, sampler, logits processors and fused ops from the registry
- profile:  on CUDA, the peaks of the worst steps on a one-block scratch cache (returned, see
            :func:`profile_step_memory`), kept out of the KV budget
- size:     the KV cache's block count (given, or from the memory left); every rank of a placement agrees
- allocate: the KV cache of the layers it holds (a pipeline stage's range, else all) and its manager
- capture:  the graph runner around the composed model (CUDA graphs where it captures)
- warm up:  on CPU in bfloat16/float16, one dummy prefill of the token budget (see :func:`warm_up`)
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from corerun.plugin.capabilities import Need
from corerun.errors import ConfigError
from corerun.kv_cache.memory import check_kv_cache_fits
from corerun.runner.logits_processing import LogitsProcessors
from corerun.protocols.graph import GraphLimits, ModelInputs
from corerun.protocols.sampler import SamplingMetadata
from corerun.runner import profile
from corerun.runner.profile import StepMemory
from corerun.sampling_params import SamplingParams
from corerun.platform.host import apply_threads, keep_freed_memory, parallel_tokens, release_openmp_threads, step_pools

logger = logging.getLogger("corerun.runner")


def build(runner: Any, tp: Any) -> None:
    """Construct ``runner`` (its ``config`` and ``registry`` set) for tensor-parallel group ``tp`` (None: one device)."""
    runner.registry.check_names(runner.config)  # a wrong or duplicated name fails now, not after the model loads
    load(runner, tp)
    limits, need = select(runner, tp)
    select_fused_ops(runner)
    select_lora(runner, tp, limits)  # (before sizing: the KV cache gets what the slots leave)
    per_block = runner.attention.kv_cache_bytes_per_block() * len(stage_layers(runner))
    runner.step_memory = profile_step_memory(runner, limits) if _sized_from_memory(runner) and profiles_step_memory(runner.device) else None
    runner.num_blocks = size(runner, per_block, tp)
    allocate(runner, need)
    capture(runner, limits)
    if warms_up(runner, tp):
        warm_up(runner)
    if runner.device.type == "cpu":  # the steps may run on another thread (the engine's loop): theirs is then the only OpenMP pool
        release_openmp_threads()
    mc = runner.model_config
    logger.info(
        "model %s (%s) on %s/%s: attention=%s fused_ops=%s kv_cache=%s (%d blocks of %d) graph=%s sampler=%s",
        runner.model_dir, ",".join(mc.architectures), runner.device, str(runner.dtype).removeprefix("torch."),
        runner.attention_name, runner.fused_ops_name, runner.kv_manager_name, runner.num_blocks, runner.block_size,
        runner.graph_name, runner.sampler_name,
    )


def load(runner: Any, tp: Any) -> None:
    """The model on its device, with the runner's dtype, vocabulary, block size and max_model_len."""
    from corerun.models.loader import load_model
    from corerun.runner.model_runner import resolve_device, resolve_dtype

    config = runner.config
    runner.device = device = resolve_device(config.device)
    if device.type == "cpu":
        keep_freed_memory()  # before the weights load: every thread's steps reuse what the last step freed
    placement = getattr(runner, "placement", None)  # a rank of a placement (corerun.executor.stage)
    ranks = placement.world_size if placement is not None else tp.world_size if tp is not None else 1
    runner.threads = apply_threads(config.threads, ranks)  # torch's intra-op pool, shared by this host's ranks
    runner.step_pools = step_pools(runner.threads, config.threads == "auto")  # a step's threads, below / from 512 tokens
    # unseeded requests draw from torch's default generators: seeded here, a run repeats itself
    torch.manual_seed(config.seed)
    runner.model_dir = model_dir_for(config)
    quant = select_quantization(runner, device)
    runner.model, runner.model_config = load_model(
        runner.model_dir,
        dtype=lambda model_dtype: resolve_dtype(config.dtype, device, model_dtype),
        device=device,
        allow_pickle=config.allow_pickle_weights,
        tp=tp,
        quant=quant,
        layers=runner.stage_layers if placement is not None and placement.pipeline_parallel_size > 1 else None,
    )
    mc = runner.model_config
    runner.dtype = next(runner.model.parameters()).dtype
    dtype = str(runner.dtype).removeprefix("torch.")
    runner.parallel_tokens = parallel_tokens(dtype, products=getattr(quant, "parallel_tokens", None))  # threads: auto's large step
    runner.vocab_size = mc.vocab_size
    runner.block_size = config.kv_cache.block_size
    ml = config.scheduler.max_model_len
    runner.max_model_len = mc.max_model_len if ml == "auto" else ml
    runner.max_num_batched_tokens = config.scheduler.token_budget(device.type, dtype)
    if runner.max_model_len > mc.max_model_len:
        raise ConfigError(
            f"scheduler.max_model_len: {runner.max_model_len} is longer than the model's "
            f"supported length {mc.max_model_len}"
        )


def select(runner: Any, tp: Any) -> tuple[GraphLimits, Need]:
    """Attention backend (the user's choice, or the best capable one for ``auto``), graph runner, sampler and
    logits processors; the graph runner and sampler are chosen before sizing, which leaves room for what they need."""
    config, registry = runner.config, runner.registry
    kv = config.kv_cache
    spec = replace(runner.model.attention_spec(runner.dtype, runner.block_size, runner.device),
                   kv_cache_dtype=kv.dtype, kv_scales=(kv.k_scale, kv.v_scale))
    choose = registry.select  # explicit names as asked; `auto` by priority among what fits (registry.py)
    runner.attention_name = choose("attention", config.attention.name, spec).name
    runner.attention = registry.create("attention", runner.attention_name, spec, options=config.attention.options)
    need = Need(runner.device, attention=runner.attention, tensor_parallel=tp is not None and tp.world_size > 1,
                lora=config.lora.enabled)
    graph = config.graph.runner.name
    placement = getattr(runner, "placement", None)
    if placement is not None and placement.pipeline_parallel_size > 1:  # a stage's input arrives between steps
        if graph not in ("auto", "eager"):
            raise ConfigError(f"graph.runner: {graph!r} cannot run a pipeline stage (pipeline_parallel_size "
                              f"{placement.pipeline_parallel_size}); use graph.runner: eager (or auto)")
        graph = "eager"
    runner.graph_name = choose("graph", graph, need, "graph.runner").name
    limits = GraphLimits(
        max_batch_size=min(config.graph.max_batch_size, config.scheduler.max_num_seqs),
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        hidden_size=runner.model_config.hidden_size,
        dtype=runner.dtype,
        device=runner.device,
        lora=config.lora.enabled,
    )
    runner.sampler_name = choose("sampler", config.sampler.name, need).name
    runner.sampler = registry.create("sampler", runner.sampler_name, runner.vocab_size, runner.device,
                                     options=config.sampler.options)
    # requests finished since the sampler was last called (SamplingMetadata.finished_seq_ids); read
    # and written by sample_tokens only, which runs one step at a time
    runner._finished_for_sampler = set()
    runner.logits_processors = LogitsProcessors(  # between logits and sampler (corerun.runner.logits_processing)
        registry, runner.vocab_size, runner.device, runner.sampler_name, runner.sampler.capabilities
    )
    return limits, need


def select_fused_ops(runner: Any) -> None:
    """The model's RMSNorm, SiLU-and-mul and RoPE (``fused_ops``, selected like every plugin kind for the
    model's device and dtype), handed to its layers; the built-in ``torch`` one is their own code (``inline``),
    so they keep running it with nothing handed over."""
    from corerun.models.fused_ops import use_fused_ops
    from corerun.protocols.fused_ops import FusedOpsNeed

    choice = runner.config.fused_ops
    need = FusedOpsNeed(runner.device, str(runner.dtype).removeprefix("torch."))
    runner.fused_ops_name = runner.registry.select("fused_ops", choice.name, need, "fused_ops").name
    ops = runner.registry.create("fused_ops", runner.fused_ops_name, options=choice.options)
    runner.fused_ops = None if getattr(ops, "inline", False) else ops  # what the layers call (None: their own code)
    use_fused_ops(runner.model, runner.fused_ops)


def select_lora(runner: Any, tp: Any, limits: GraphLimits) -> None:
    """With ``lora.enabled``: the LoRA kernel (``lora.kernel``, selected like every plugin kind) and the
    adapters' layers and device slots (:mod:`corerun.lora.manager`)."""
    from corerun.lora.manager import LoRAManager
    from corerun.protocols.lora import LoRANeed

    lc, registry = runner.config.lora, runner.registry
    runner.lora = None
    if not lc.enabled:
        return
    if getattr(runner, "pipelined", False):
        raise ConfigError("lora.enabled does not run with pipeline parallelism yet; use pipeline_parallel_size: 1")
    graphs = bool(getattr(registry.get("graph", runner.graph_name).capabilities, "captures", False))
    need = LoRANeed(runner.device, str(runner.dtype).removeprefix("torch."), lc.max_lora_rank, lc.max_loras, graphs)
    name = registry.select("lora", lc.kernel.name, need, "lora.kernel").name
    kernel = registry.create("lora", name, options=lc.kernel.options)
    sc = runner.config.scheduler
    runner.lora = LoRAManager(
        runner.model, kernel, max_loras=lc.max_loras, max_lora_rank=lc.max_lora_rank, max_cpu_loras=lc.max_cpu_loras,
        max_tokens=max(runner.max_num_batched_tokens, sc.max_num_seqs, limits.max_batch_size), dtype=runner.dtype,
        device=runner.device,
    )


def size(runner: Any, per_block: int, tp: Any) -> int:
    """KV-cache blocks: sized from the memory budget (less the profiled step memory) unless given; every
    tensor-parallel rank allocates (and the engine schedules into) the smallest count."""
    from corerun.kv_cache.sizing import num_blocks_for_budget

    kc = runner.config.kv_cache
    if _sized_from_memory(runner):
        num_blocks = num_blocks_for_budget(
            per_block, device=runner.device, memory_fraction=kc.memory_fraction, cpu_memory_gb=kc.cpu_memory_gb,
            reserved_bytes=runner.step_memory.reserved_bytes if runner.step_memory else 0,
        )
    else:
        num_blocks = kc.num_blocks
        check_kv_cache_fits(num_blocks, per_block, runner.device)
    agree = getattr(runner, "placement_group", None) or tp  # every rank of the placement, every stage
    if agree is not None and agree.world_size > 1:
        num_blocks = agree.min_int(num_blocks)
    return num_blocks


def stage_layers(runner: Any) -> range:
    """The decoder layers this runner holds: a pipeline stage's range (``runner.stage_layers``), else all."""
    start, end = getattr(runner, "stage_layers", None) or (0, runner.model_config.num_layers)
    return range(start, end)


def allocate(runner: Any, need: Need) -> None:
    """The KV cache of every layer, and the KV-cache manager that hands out its blocks."""
    config = runner.config
    mine = stage_layers(runner)  # a pipeline stage allocates its own layers' caches; None stands for the others'
    runner.kv_caches = [runner.attention.allocate_kv_cache(runner.num_blocks) if i in mine else None
                        for i in range(runner.model_config.num_layers)]
    runner.kv_manager_name = runner.registry.select("kv_cache", config.kv_cache.manager.name, need, "kv_cache.manager").name
    runner.kv_manager = runner.registry.create(
        "kv_cache", runner.kv_manager_name, runner.num_blocks, runner.block_size,
        prefix_caching=config.kv_cache.prefix_caching, options=config.kv_cache.manager.options,
    )


def capture(runner: Any, limits: GraphLimits) -> None:
    """The graph runner around the composed model, captured now that the KV cache exists."""
    runner.graph = runner.registry.create(
        "graph", runner.graph_name, weak_model_fn(runner), runner.attention, limits,
        options=runner.config.graph.runner.options,
    )
    runner.graph.capture()
    # (a runner that only plans and calls the model: ModelRunner._forward does that itself)
    runner.graph_passthrough = bool(getattr(runner.registry.get("graph", runner.graph_name).capabilities, "passthrough", False))


# ------------------------------------------------------------------ warm up
WARMUP_PROMPT_TOKENS = 256  # the dummy prompts' length: a full budget of short prompts, as a batch of requests arrives


def warms_up(runner: Any, tp: Any) -> bool:
    """One process on a CPU, in a half-precision dtype, unless ``graph.warmup`` is off.

    oneDNN, under torch's bfloat16 / float16 products on CPU, builds its kernels for each new number of rows on
    first use: a full 4096-token bfloat16 step of the default model took 1.50-1.56 s the first time and
    1.15-1.27 s once a step of that size had run (benchmarks/RESULTS.md, "Warm-up").  float32 products showed
    no such cost (their weights are packed at load: ``prepack_cpu_weights``).  Ranks of a group would have to
    warm up in step; they do not.
    """
    return (runner.config.graph.warmup and runner.device.type == "cpu" and runner.dtype in (torch.bfloat16, torch.float16)
            and tp is None and getattr(runner, "placement", None) is None)


@torch.no_grad()
def warm_up(runner: Any) -> None:
    """Run one prefill of ``max_num_batched_tokens`` tokens (fresh prompts of :data:`WARMUP_PROMPT_TOKENS`
    tokens, or ``max_model_len`` if shorter) on a one-block scratch cache; its outputs are dropped and
    the KV cache is untouched."""
    t0 = time.perf_counter()
    length = min(WARMUP_PROMPT_TOKENS, runner.max_model_len)
    count = max(1, min(runner.config.scheduler.max_num_seqs, runner.max_num_batched_tokens // length))
    inputs = profile.dummy_step([length] * count, [0] * count, runner.block_size, runner.device)
    threads = runner.step_threads(inputs.batch.num_tokens)
    before_threads, kv_caches = torch.get_num_threads(), runner.kv_caches
    runner.kv_caches = [runner.attention.allocate_kv_cache(1) if c is not None else None for c in kv_caches]
    try:
        torch.set_num_threads(threads)
        runner._model_fn(inputs.input_ids, inputs.positions, runner.attention.plan(inputs.batch))
    finally:
        runner.kv_caches = kv_caches
        torch.set_num_threads(before_threads)
    logger.info("warm-up: a prefill of %d tokens (%d prompts of %d) on %d thread(s) in %.2f s",
                inputs.batch.num_tokens, count, length, threads, time.perf_counter() - t0)


# ------------------------------------------------------------------ profile
def _sized_from_memory(runner: Any) -> bool:
    return runner.config.kv_cache.num_blocks == "auto"


def profiles_step_memory(device: torch.device) -> bool:
    """Only CUDA measures its step memory; elsewhere ``kv_cache.cpu_memory_gb`` is the KV budget itself."""
    return device.type == "cuda"


@torch.no_grad()  # not inference mode: a sampler may keep buffers it makes here and write them later
def profile_step_memory(runner: Any, limits: GraphLimits) -> StepMemory:
    """Run the worst prefill, the widest eager decode, the widest sampling and (when graphs are
    captured) the largest captured decode once each on a one-block scratch cache, and return their
    peaks (see :mod:`corerun.runner.profile`).  Every rank of a tensor-parallel group runs the same
    forwards in the same order; only the rank holding the logits samples."""
    sc, bs, dev, mc = runner.config.scheduler, runner.block_size, runner.device, runner.model_config
    prefill = profile.worst_prefill(runner.max_num_batched_tokens, runner.max_model_len, sc.max_num_seqs, bs, dev)
    decode_rows = min(sc.max_num_seqs, runner.max_num_batched_tokens)
    decode = profile.widest_decode(decode_rows, runner.max_model_len, bs, dev)
    reg = runner.registry.get("graph", runner.graph_name)
    captures = bool(getattr(reg.capabilities, "captures", False)) and bool(
        getattr(runner.attention.capabilities, "cuda_graph_decode", False)
    )
    captured = profile.captured_decode(limits) if captures else None
    rows = sc.max_num_seqs
    params, what = widest_sampling(runner.sampler, runner.config.max_logprobs, rows)
    runner.kv_caches = [runner.attention.allocate_kv_cache(1).zero_() for _ in range(mc.num_layers)]
    marks: list[int] = []  # the high-water mark before each measurement resets it

    def peak(run: Any) -> int:
        marks.append(profile.high_water(dev))
        return profile.peak_bytes(run, dev)

    try:
        def forward(inputs: ModelInputs) -> torch.Tensor:
            return runner._model_fn(inputs.input_ids, inputs.positions, runner.attention.plan(inputs.batch))

        # (the first prefill also compiles / autotunes the backend's kernels: triton's autotuner
        # times candidates with a 256 MiB scratch buffer, which this peak then includes, and which
        # a later autotune for another tile shape needs again)
        prefill_bytes = peak(lambda: forward(prefill))
        decode_bytes = peak(lambda: forward(decode))
        hidden = torch.randn(rows, mc.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev, runner.dtype)

        def sample() -> None:
            # a real step still holds its hidden states [num_tokens, hidden] while it samples
            held = torch.empty(prefill.batch.num_tokens, mc.hidden_size, dtype=runner.dtype, device=dev)
            logits = runner.model.compute_logits(hidden)
            if logits is not None:  # tensor parallel: the rank holding the logits samples
                prompts = [list(range(1, 9))] * rows
                runner.sampler.sample(logits, SamplingMetadata(params, prompts, [[1, 2]] * rows))
            del held  # (only now: it was part of the peak)

        sampling_bytes = peak(sample)
        graph_bytes = peak(lambda: forward(captured)) if captured is not None else 0
    finally:
        runner.kv_caches = []
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    memory = profile.StepMemory(
        prefill_bytes, decode_bytes, sampling_bytes, graph_bytes,
        prefill.batch.num_tokens, prefill.batch.num_reqs, decode_rows, max(marks),
    )
    mib = 2.0**20
    logger.info(
        "kv_cache: step memory kept out of the KV budget: %.1f MiB (prefill of %d tokens in %d requests at "
        "max_model_len %d: %.1f MiB; eager decode of %d: %.1f MiB; sampling %d rows %s: %.1f MiB; captured "
        "decode of %d: %.1f MiB)",
        memory.reserved_bytes / mib, memory.prefill_tokens, memory.prefill_requests, runner.max_model_len,
        prefill_bytes / mib, decode_rows, decode_bytes / mib, rows, what, sampling_bytes / mib,
        limits.max_batch_size if captures else 0, graph_bytes / mib,
    )
    return memory


def widest_sampling(sampler: Any, max_logprobs: int, rows: int) -> tuple[list[SamplingParams], str]:
    """Parameters for ``rows`` rows that take every path ``sampler`` accepts: greedy rows mixed
    with rows using all its other parameters (seeded, truncated, penalised, with logprobs)."""
    everything = SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
        presence_penalty=0.2, seed=1, logprobs=min(max_logprobs, 20) or None, logit_bias={0: 1.0},
    )
    for rich, what in ((everything, "with every parameter"), (SamplingParams(temperature=0.8, seed=1), "temperature, seed")):
        try:
            sampler.check(rich)
        except Exception:
            continue
        return [SamplingParams(temperature=0.0) if i % 2 else rich for i in range(rows)], what
    return [SamplingParams()] * rows, "defaults"


def model_dir_for(config: Any) -> Path:
    """The folder to load: ``model`` itself (a Hugging Face Hub id resolved to its local snapshot, for
    every entry point: ``LLM``, the CLI, the server), a folder made for a ``.gguf`` file, or the default
    model's (its shipped Q4_1 file with ``quantization: gguf`` or another method reading GGUF, else its converted bfloat16 folder)."""
    from corerun.models.gguf_convert import gguf_model_dir
    from corerun.models.hub import resolve_model

    if config.model:
        model = resolve_model(str(config.model))
        return gguf_model_dir(model) if model.endswith(".gguf") else Path(model)
    if _reads_gguf(config.quantization.name):
        from corerun.models.default import find_default_gguf

        return gguf_model_dir(find_default_gguf())
    return default_model_dir()


def _reads_gguf(name: str) -> bool:
    """Whether the quantization method ``name`` reads GGUF blocks (``gguf``, ``gguf_cpu``, a plugin's):
    the default model then runs from its shipped file. ``auto`` and dense methods keep the float folder."""
    if name == "auto":
        return False
    from corerun.plugin.registry import Registry

    reg = Registry.from_environment().registrations["quantization"].get(name)
    return reg is not None and not reg.capabilities.dense and bool(reg.capabilities.gguf_types)


def select_quantization(runner: Any, device: Any) -> Any:
    """The quantization method for the checkpoint in ``runner.model_dir`` (``quantization: auto`` reads
    it from there); ``None`` for dense weights."""
    from corerun.quantization.checkpoint import checkpoint_format

    choice = runner.config.quantization
    found = replace(checkpoint_format(runner.model_dir, device, _run_dtype(runner, device)),
                    compiled=runner.config.graph.runner.name == "compile")
    runner.quantization_name = runner.registry.select("quantization", choice.name, found).name
    method = runner.registry.create("quantization", runner.quantization_name, options=choice.options)
    return None if method.dense else method


def _run_dtype(runner: Any, device: Any) -> str | None:
    """The dtype :func:`load` will give the model, by name (a method declares the activation dtypes it takes);
    ``None`` when ``dtype: auto`` off CPU meets a ``config.json`` that does not read."""
    from corerun.runner.model_runner import resolve_dtype

    model_dtype = None
    if runner.config.dtype == "auto" and getattr(device, "type", str(device)) != "cpu":
        try:
            from corerun.models.config import ModelConfig

            model_dtype = ModelConfig.from_model_dir(runner.model_dir).torch_dtype
        except Exception:  # noqa: BLE001 - the load reports an unreadable config.json with its own error
            return None
    return str(resolve_dtype(runner.config.dtype, torch.device(device), model_dtype)).removeprefix("torch.")


def default_model_dir() -> Path:
    from corerun.models.default import default_model_dir as default

    return default()


def weak_model_fn(runner: Any) -> Any:
    """``runner._model_fn`` without a reference to ``runner``: the graph runner keeps this, and a bound
    method would make a cycle that holds the KV cache and graph pool until a full garbage collection."""
    ref = weakref.ref(runner)

    def model_fn(input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        return ref()._model_fn(input_ids, positions, metadata)  # type: ignore[union-attr]

    return model_fn
