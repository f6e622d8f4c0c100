"""Capability declarations: plain data, importable without torch (plugins register them at listing time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Sampling fields the engine itself handles; every sampler "honours" them.
ENGINE_PARAMS = frozenset({"n", "max_tokens", "ignore_eos", "stop_token_ids", "stop", "include_stop_str_in_output",
                           "skip_special_tokens"})
# Sampling fields served by logits processors (corerun.runner.logits_processing), before the sampler sees the logits.
PROCESSOR_PARAMS = frozenset({"structured_outputs"})


def _fmt(values: frozenset) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


def _dtype_str(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def device_reasons(devices: frozenset[str] | None, device: Any) -> list[str]:
    """``[]`` when ``device``'s type is in ``devices`` (``None``: any device); else why not."""
    dev = _device_type(device)
    return [] if devices is None or dev in devices else [f"device {dev} not in {_fmt(devices)}"]


@dataclass(frozen=True)
class Need:
    """What an implementation must fit for ``auto`` to choose it (:meth:`corerun.plugin.registry.Registry.select`).

    Each kind's capabilities read the fields that concern them: ``fits(need)`` lists why the
    implementation cannot serve it at all (an explicitly named one is refused), ``suits(need)`` what
    ``auto`` asks on top; capabilities with no ``fits`` are checked against their ``devices`` only.
    """

    device: Any  # a torch.device or a device type ("cuda:0", "cpu")
    attention: Any = None  # graph runners: the chosen attention backend (or its capabilities)
    tensor_parallel: bool = False  # graph runners: a step runs collectives across ranks
    params: frozenset[str] = frozenset()  # logits processors: the SamplingParams fields to serve
    lora: bool = False  # graph runners: steps may carry LoRA adapters (lora.enabled)


@dataclass(frozen=True)
class AttentionCapabilities:
    """What an attention backend supports. ``None`` for a set means "any value".

    ``check(spec)`` returns every reason an :class:`~corerun.protocols.AttentionSpec` is not supported.
    """

    dtypes: frozenset[str] = frozenset({"float16", "bfloat16", "float32"})
    head_sizes: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    gqa: bool = True  # num_kv_heads < num_heads (including MQA)
    cuda_graph_decode: bool = False  # a pure-decode step may be captured in a CUDA graph
    # a pure-decode step may be recorded by the CPU's ``replay`` graph runner: its C calls go through
    # corerun.protocols.replay.native and its plan reads the batch's tensors in place (``auto`` asks it)
    replay_decode: bool = False
    max_head_size: int | None = None  # for backends that take "any head size up to N"
    # device types where it runs in an interpreter or emulator, not native code (Triton on CPU): named
    # explicitly there, it is used as asked and corerun warns once that it is slow
    emulated_on: frozenset[str] = frozenset()
    sliding_window: bool = False  # per-layer sliding windows (AttentionSpec.sliding_windows)
    logits_soft_cap: bool = False  # tanh soft-capping of the scores (AttentionSpec.logits_soft_cap)
    # quantized KV caches it stores and reads (AttentionSpec.kv_cache_dtype: fp8_e4m3, fp8_e5m2, int8);
    # "auto" (K/V in the model's dtype) is always supported
    kv_cache_dtypes: frozenset[str] = frozenset()

    def check(self, spec: Any) -> list[str]:
        reasons: list[str] = []
        name = _dtype_str(spec.dtype)
        if name not in self.dtypes:
            reasons.append(f"dtype {name} not in {_fmt(self.dtypes)}")
        if self.head_sizes is not None and spec.head_size not in self.head_sizes:
            reasons.append(f"head size {spec.head_size} not in {_fmt(self.head_sizes)}")
        if self.max_head_size is not None and spec.head_size > self.max_head_size:
            reasons.append(f"head size {spec.head_size} above the maximum {self.max_head_size}")
        if self.block_sizes is not None and spec.block_size not in self.block_sizes:
            reasons.append(f"block size {spec.block_size} not in {_fmt(self.block_sizes)}")
        dev = _device_type(spec.device)
        if dev not in self.devices:
            reasons.append(f"device {dev} not in {_fmt(self.devices)}")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        elif spec.num_kv_heads != spec.num_heads and not self.gqa:
            reasons.append(
                f"grouped-query attention ({spec.num_heads} query / {spec.num_kv_heads} KV heads) not supported"
            )
        windows = sorted({w for w in getattr(spec, "sliding_windows", ()) if w is not None})
        if windows and not self.sliding_window:
            reasons.append(f"sliding-window attention (window {', '.join(map(str, windows))}) not supported")
        cap = getattr(spec, "logits_soft_cap", None)
        if cap is not None and not self.logits_soft_cap:
            reasons.append(f"attention logit soft-capping (cap {cap:g}) not supported")
        kv = getattr(spec, "kv_cache_dtype", "auto")
        if kv != "auto" and kv not in self.kv_cache_dtypes:
            have = ", ".join(sorted(self.kv_cache_dtypes)) or "none: K/V in the model's dtype only"
            reasons.append(f"kv_cache.dtype {kv} not supported (quantized KV caches it supports: {have})")
        return reasons

    def fits(self, need: Any) -> list[str]:
        """``check`` against an AttentionSpec; against a bare :class:`Need` (no model yet), the device only."""
        return self.check(need) if hasattr(need, "head_size") else device_reasons(self.devices, need.device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtypes": sorted(self.dtypes),
            "head_sizes": None if self.head_sizes is None else sorted(self.head_sizes),
            "max_head_size": self.max_head_size,
            "block_sizes": None if self.block_sizes is None else sorted(self.block_sizes),
            "devices": sorted(self.devices),
            "gqa": self.gqa,
            "cuda_graph_decode": self.cuda_graph_decode,
            "replay_decode": self.replay_decode,
            "emulated_on": sorted(self.emulated_on),
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
            "kv_cache_dtypes": sorted(self.kv_cache_dtypes),
        }


@dataclass(frozen=True)
class SamplerCapabilities:
    """The ``SamplingParams`` fields a sampler honours (beyond the engine's own ones)."""

    params: frozenset[str]
    # logits with -inf entries (a logits processor's mask) are sampled correctly: a -inf token is never
    # drawn, by any row (greedy, seeded, truncated); only such a sampler serves masked requests
    logits_mask: bool = False
    # ``sample`` can verify draft tokens (speculative decoding, corerun.spec_decode): each row's draw
    # depends only on its logits, parameters and histories, a seeded row's on ``len(output_token_ids)``
    # as its draw index, and rows are drawn independently, so one request may fill several rows
    # whose histories differ by the drafts before them
    draft_verification: bool = False

    def check(self, params: Any) -> list[str]:
        """Every field of ``params`` set away from its no-op value that this sampler does not honour."""
        return sorted(params.non_default_fields() - self.params - ENGINE_PARAMS - PROCESSOR_PARAMS)

    def to_dict(self) -> dict[str, Any]:
        return {"params": sorted(self.params), "logits_mask": self.logits_mask,
                "draft_verification": self.draft_verification}


@dataclass(frozen=True)
class KVCacheCapabilities:
    prefix_caching: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"prefix_caching": self.prefix_caching}


@dataclass(frozen=True)
class GraphRunnerCapabilities:
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    # replays captured graphs (vs. always eager): its decode steps need an attention backend that
    # declares cuda_graph_decode, and no tensor-parallel collectives inside a step
    captures: bool = False
    # runs a step whose linear layers all-reduce across tensor-parallel ranks
    tensor_parallel: bool = True
    # its ``run`` is ``attention.plan(batch)`` then the model, nothing more (``eager``): the model runner
    # then plans and calls the model itself, a hop less per step (the runner's ``stats`` stay zero)
    passthrough: bool = False
    # records steps and replays their calls on the CPU (``replay``): ``auto`` takes it only with an attention
    # backend that declares replay_decode
    records: bool = False

    def fits(self, need: Need) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        if need.tensor_parallel and not self.tensor_parallel:
            reasons.append("does not run tensor-parallel steps (their collectives are not compiled); use tensor_parallel_size 1")
        return reasons

    def suits(self, need: Need) -> list[str]:
        """What ``auto`` also asks (a runner named explicitly still runs, replaying what it safely can)."""
        reasons = []
        if self.captures:
            attention = getattr(need.attention, "capabilities", need.attention)
            if not getattr(attention, "cuda_graph_decode", False):
                reasons.append("captures graphs, and the attention backend does not declare its decode path "
                               "CUDA-graph safe (cuda_graph_decode=False)")
            if need.tensor_parallel:
                reasons.append("captures graphs, and tensor-parallel steps run collectives, which are not captured")
        if self.records:
            attention = getattr(need.attention, "capabilities", need.attention)
            if not getattr(attention, "replay_decode", False):
                reasons.append("records decode steps, and the attention backend does not declare them recordable "
                               "(replay_decode=False)")
            if getattr(need, "lora", False):
                reasons.append("records decode steps, and LoRA adapters set their per-step state outside the model")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {"devices": sorted(self.devices), "captures": self.captures, "tensor_parallel": self.tensor_parallel,
                "passthrough": self.passthrough, "records": self.records}


@dataclass(frozen=True)
class LogitsProcessorCapabilities:
    """What a logits processor serves and costs.

    - ``params``: the ``SamplingParams`` fields it serves; a request uses the processor when one of them
      is set away from its default (``structured_outputs``).
    - ``host_sync``: ``apply`` reads device values on the host (a sync per step); ``False`` promises it
      only copies host data to the device.
    - ``devices``: device types it runs on.
    """

    params: frozenset[str]
    host_sync: bool = False
    devices: frozenset[str] = frozenset({"cpu", "cuda"})

    def used_by(self, params: Any) -> bool:
        return bool(self.params & params.non_default_fields())

    def fits(self, need: Need) -> list[str]:
        missing = need.params - self.params
        return device_reasons(self.devices, need.device) + ([f"does not serve {_fmt(missing)}"] if missing else [])

    def to_dict(self) -> dict[str, Any]:
        return {"params": sorted(self.params), "host_sync": self.host_sync, "devices": sorted(self.devices)}


@dataclass(frozen=True)
class QuantizationCapabilities:
    """What a quantization method reads and runs (``corerun.quantization``).

    - ``quant_methods``: the ``quantization_config.quant_method`` values of ``config.json`` it reads.
    - ``gguf_types``: the GGML tensor types it reads from a ``.gguf`` file.
    - ``dense``: reads checkpoints with no quantization (float safetensors).
    - ``bits``, ``group_sizes``: weight bits and values per scale group of the formats it reads.
    - ``zero_point``: its formats carry a zero point or minimum (asymmetric), besides symmetric ones.
    - ``activation_dtypes``, ``devices``: what its layers take and where they run.
    - ``int8_activations``: its layers may quantize the activations to int8 (scale ``max|x| / 127`` per
      token, or per smaller group of a token's values) before the product, as W8A8 formats do and as
      llama.cpp does for GGUF blocks; its conformance bound then adds half an activation step.
    - ``compiles``: its layers trace under torch.compile (``graph.runner: compile``); ``False`` for one whose
      products are opaque C++ or oneDNN-packed weights the compiler cannot lower.

    ``fits(checkpoint)`` lists why it cannot read a :class:`corerun.quantization.CheckpointFormat` (its
    ``dtype``, when known, checked against ``activation_dtypes``).
    """

    quant_methods: frozenset[str] = frozenset()
    gguf_types: frozenset[str] = frozenset()
    dense: bool = False
    bits: frozenset[float] = frozenset()
    group_sizes: frozenset[int] = frozenset()
    zero_point: bool = False
    activation_dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    int8_activations: bool = False
    compiles: bool = True

    def reads(self) -> str:
        """What it reads, in words (for errors)."""
        parts = [f"quantization_config.quant_method {_fmt(self.quant_methods)}"] if self.quant_methods else []
        if self.gguf_types:
            parts.append(f"GGUF tensor types {_fmt(self.gguf_types)}")
        if self.dense:
            parts.append("unquantized float checkpoints")
        return " and ".join(parts) or "nothing"

    def fits(self, need: Any) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        method, gguf_types = getattr(need, "quant_method", None), frozenset(getattr(need, "gguf_types", ()))
        if method is not None and method not in self.quant_methods:
            reasons.append(f"the checkpoint's quantization_config.quant_method is {method!r}; it reads {self.reads()}")
        elif gguf_types - self.gguf_types:
            reasons.append(f"the checkpoint holds GGUF tensor types {_fmt(gguf_types - self.gguf_types)}; it reads {self.reads()}")
        elif method is None and not gguf_types and not self.dense:
            reasons.append(f"the checkpoint is not quantized; it reads {self.reads()}")
        dtype = getattr(need, "dtype", None)
        if dtype is not None and dtype not in self.activation_dtypes:
            reasons.append(f"the model runs in {dtype}; its layers take {_fmt(self.activation_dtypes)}")
        if getattr(need, "compiled", False) and not self.compiles:
            reasons.append("the model runs under graph.runner: compile; its layers do not trace under torch.compile")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_methods": sorted(self.quant_methods), "gguf_types": sorted(self.gguf_types), "dense": self.dense,
            "bits": sorted(self.bits), "group_sizes": sorted(self.group_sizes), "zero_point": self.zero_point,
            "activation_dtypes": sorted(self.activation_dtypes), "devices": sorted(self.devices),
            "compiles": self.compiles,
        }


@dataclass(frozen=True)
class ExecutorCapabilities:
    """What an executor (``corerun.protocols.executor``) can start.

    - ``max_world_size``: the most ranks (tensor x pipeline) it starts; ``None``: any.
    - ``pipeline_parallel``: it runs placements of several stages (its ``collect`` returns the last
      stage's replies).
    - ``multi_host``: its ranks may run on other hosts (the rendezvous store listens beyond 127.0.0.1).
    - ``async_safe``: ``send`` and ``collect`` may run on the engine's step thread while
      ``quick_check`` runs on the loop thread.
    - ``starts_ranks``: ``start`` starts the other ranks itself; ``False`` when something else does
      (torchrun), which the conformance suite cannot do for it.
    - ``devices``: the device types its ranks run on.

    ``fits(need)`` lists why it cannot start ``need.placement`` (``need.multi_host``: the ranks join
    through ``distributed.init_method``).
    """

    max_world_size: int | None = None
    pipeline_parallel: bool = True
    multi_host: bool = False
    async_safe: bool = False
    starts_ranks: bool = True
    devices: frozenset[str] = frozenset({"cpu", "cuda"})

    def fits(self, need: Any) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        placement = getattr(need, "placement", None)
        if placement is not None:
            world, pp = placement.world_size, placement.pipeline_parallel_size
            if self.max_world_size is not None and world > self.max_world_size:
                reasons.append(f"it starts at most {self.max_world_size} rank(s); tensor_parallel_size x "
                               f"pipeline_parallel_size is {world}")
            if pp > 1 and not self.pipeline_parallel:
                reasons.append(f"it does not run pipeline stages (pipeline_parallel=False); pipeline_parallel_size is {pp}")
        if getattr(need, "multi_host", False) and not self.multi_host:
            reasons.append("its ranks run on this host only (multi_host=False), but distributed.init_method is set")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {"max_world_size": self.max_world_size, "pipeline_parallel": self.pipeline_parallel,
                "multi_host": self.multi_host, "async_safe": self.async_safe, "starts_ranks": self.starts_ranks,
                "devices": sorted(self.devices)}


ATTENTION_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model family (a ``model`` plugin, registered under an ``architectures`` name) runs.

    - ``tensor_parallel``: the class takes ``tp=`` and holds one rank's heads, features and vocabulary.
    - ``attention``: the attention kinds its layers may ask for, of :data:`ATTENTION_KINDS`: ``full``
      (causal over the whole sequence) and ``sliding`` (causal over the last ``sliding_window``
      tokens); which layer asks for which, for one config, is the class's ``layer_attention(config)``.
    - ``experts``: it has mixture-of-experts layers.
    - ``devices``: the device types it runs on.

    ``fits(need)`` lists why it cannot serve a :class:`Need` (``tensor_parallel``, ``device``).
    """

    tensor_parallel: bool = False
    attention: frozenset[str] = frozenset({"full"})
    experts: bool = False
    devices: frozenset[str] = frozenset({"cpu", "cuda"})

    def __post_init__(self) -> None:
        unknown = set(self.attention) - set(ATTENTION_KINDS)
        if unknown or not self.attention:
            raise ValueError(f"ModelCapabilities.attention {_fmt(frozenset(self.attention))}: each must be one of "
                             f"{', '.join(ATTENTION_KINDS)} (at least one)")

    def fits(self, need: Any) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        if getattr(need, "tensor_parallel", False) and not self.tensor_parallel:
            reasons.append("it does not support tensor parallelism (tensor_parallel=False); use tensor_parallel_size: 1")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {"tensor_parallel": self.tensor_parallel, "attention": sorted(self.attention), "experts": self.experts,
                "devices": sorted(self.devices)}


@dataclass(frozen=True)
class LoRAKernelCapabilities:
    """What a LoRA kernel runs, as data.

    - ``devices``: device types; ``dtypes``: model dtypes of ``y`` and ``x`` (``"float32"``, ...).
    - ``max_rank`` / ``max_slots``: the largest ``R`` and ``S`` it takes (``None``: any).
    - ``graph_safe``: no host synchronisation, none of the step's host values (``LoRATokens``'
      ``num_tokens``, ``num_base``, ``host_counts``) and no shape that depends on the tokens' slots,
      so a captured CUDA graph replays it with other slots.
    - ``grouped``: it groups tokens by slot (one product per adapter present) rather than gathering
      each token's weights.

    ``fits(need)`` lists every reason it cannot serve a :class:`LoRANeed` (a bare
    :class:`~corerun.plugin.capabilities.Need` is checked for its device only).
    """

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16", "float32", "float64"})
    max_rank: int | None = None
    max_slots: int | None = None
    graph_safe: bool = False
    grouped: bool = False

    def fits(self, need: Any) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        dtype = getattr(need, "dtype", None)
        if dtype is not None and str(dtype).removeprefix("torch.") not in self.dtypes:
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')} not in {_fmt(self.dtypes)}")
        rank, slots = getattr(need, "max_rank", None), getattr(need, "max_slots", None)
        if rank is not None and self.max_rank is not None and rank > self.max_rank:
            reasons.append(f"max_lora_rank {rank} above its largest rank {self.max_rank}")
        if slots is not None and self.max_slots is not None and slots > self.max_slots:
            reasons.append(f"max_loras {slots} above its largest slot count {self.max_slots}")
        if getattr(need, "graphs", False) and not self.graph_safe:
            reasons.append("decode steps replay CUDA graphs and it is not graph_safe")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": sorted(self.devices), "dtypes": sorted(self.dtypes), "max_rank": self.max_rank,
            "max_slots": self.max_slots, "graph_safe": self.graph_safe, "grouped": self.grouped,
        }


@dataclass(frozen=True)
class FusedOpsCapabilities:
    """What a ``fused_ops`` implementation (RMSNorm, SiLU-and-mul, RoPE; ``corerun.protocols.fused_ops``) runs.

    - ``devices``: device types; ``dtypes``: the model dtypes its ops take and return.

    ``fits(need)`` lists every reason it cannot serve a :class:`~corerun.protocols.fused_ops.FusedOpsNeed`
    (a bare :class:`Need` is checked for its device only).
    """

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16", "float32", "float64"})

    def fits(self, need: Any) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        dtype = getattr(need, "dtype", None)
        if dtype is not None and _dtype_str(dtype) not in self.dtypes:
            reasons.append(f"dtype {_dtype_str(dtype)} not in {_fmt(self.dtypes)}")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {"devices": sorted(self.devices), "dtypes": sorted(self.dtypes)}
