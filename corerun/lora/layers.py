"""The linear layers adapters target, and the wrapper that adds each token's adapter to their output.

:func:`lora_targets` describes a model's linear layers (attention and MLP projections) from what the
layers carry (``shard_sizes`` / ``shard_ranges`` of merged layers, ``full_in_features`` of a
row-parallel one) and the family's ``packed_modules_mapping``, without importing the models:

- a merged layer (``qkv_proj``, ``gate_up_proj``) is one slice per checkpoint module (``q_proj``,
  ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``), each holding its rank's rows;
- a row-parallel layer (``o_proj``, ``down_proj`` under tensor parallelism) holds a range of the input
  features: its slice of A is applied to its slice of ``x`` and the partial products are summed with
  the base product by the layer's own all-reduce.

:class:`LoRALinear` replaces such a layer when ``lora.enabled`` is set (nothing changes otherwise).
Its A and B stacks, ``[S, R, in]`` and ``[S, out_i, R]`` per slice, are written by
:class:`corerun.lora.manager.LoRAManager`; the step's tokens (:class:`~corerun.lora.tokens.LoRATokens`:
their slots, their order by slot, each slot's count) and the slots' scalings are the manager's fixed
device tensors, refilled once before every forward, so a captured CUDA graph replays with the step's
slots and every layer's kernel call finds the step's bookkeeping done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from corerun.lora.tokens import LoRATokens
from corerun.protocols.lora import LoRAKernel


@dataclass(frozen=True)
class SliceSpec:
    """One checkpoint module inside a layer: this rank's rows ``[start, start + size)`` of its ``full`` rows."""

    module: str  # the checkpoint's (and PEFT's) module name: q_proj, gate_proj, o_proj, ...
    start: int
    size: int
    full: int


@dataclass(frozen=True)
class LoRATarget:
    """A linear layer adapters may target: ``name`` in the model, its input features (``in_full`` in
    the checkpoint, this rank's ``[in_start, in_start + in_size)``) and its output slices."""

    name: str
    in_full: int
    in_start: int
    in_size: int
    slices: tuple[SliceSpec, ...]

    @property
    def parent(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]


# A mixture-of-experts block's parts, by name (the model's modules and the checkpoints' alike): its
# experts, its router (Mixtral's ``block_sparse_moe.gate``, Qwen-MoE's and newer Mixtral's ``mlp.gate``)
# and its shared expert with that expert's gate (Qwen2-MoE).
_MOE = re.compile(r"\.(experts|shared_expert|shared_expert_gate|block_sparse_moe)(\.|$)|\.mlp\.gate$")


def in_moe_block(name: str) -> bool:
    """Whether module ``name`` (``model.layers.0.mlp.experts.3.down_proj``, as the model or an adapter's
    checkpoint names it) is part of a mixture-of-experts block: no adapter target (those models take
    adapters on attention and on the MLPs of dense layers)."""
    return _MOE.search(name) is not None


def _is_linear(module: nn.Module) -> bool:
    return isinstance(getattr(module, "in_features", None), int) and hasattr(module, "product")


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """Every linear layer of ``model`` adapters may target, by name (its ``packed_modules_mapping`` names
    the slices), but none inside a mixture-of-experts block (:func:`in_moe_block`); read before
    :func:`install` wraps them."""
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {}) or {}
    checkpoint_name = {(ours, shard): ckpt for ckpt, (ours, shard) in packed.items()}
    targets: dict[str, LoRATarget] = {}
    # an LM head's layer from its quantization method (LMHead.quantized, a method's lm_head()): the head is no target
    heads = {id(q) for m in model.modules() if isinstance(q := getattr(m, "quantized", None), nn.Module)}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear) or not _is_linear(module) or in_moe_block(name) or id(module) in heads:
            continue  # (a mixture-of-experts block's router and shared expert are not targets: its experts are not linear layers)
        leaf = name.rpartition(".")[2]
        ranges = getattr(module, "shard_ranges", None)
        sizes = getattr(module, "shard_sizes", None)
        if ranges is not None:
            slices = [SliceSpec(checkpoint_name.get((leaf, s), str(s)), a, n, f) for s, (a, n, f) in ranges.items()]
        elif sizes is not None:
            slices = [SliceSpec(checkpoint_name.get((leaf, s), str(s)), 0, n, n) for s, n in sizes.items()]
        else:
            slices = [SliceSpec(leaf, 0, module.out_features, module.out_features)]
        in_full = getattr(module, "full_in_features", module.in_features)
        targets[name] = LoRATarget(name, in_full, getattr(module, "in_start", 0), module.in_features, tuple(slices))
    return targets


class LoRAStepState:
    """What every :class:`LoRALinear` of a model shares: the kernel, the step's tokens (their slots and
    their order by slot, :class:`~corerun.lora.tokens.LoRATokens`, refilled once per step) and the
    slots' scalings (float32 ``[S]``), fixed device tensors."""

    def __init__(self, kernel: LoRAKernel, num_slots: int, max_tokens: int, device: torch.device) -> None:
        self.kernel = kernel
        self.tokens = LoRATokens(num_slots, max_tokens, device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.enabled = True  # False: the layers run their base product only (``corerun bench --lora``'s base runs)


class LoRALinear(nn.Module):
    """``base(x)`` plus, for each token, its slot's adapter (``kernel.add_lora``); ``base``'s other
    attributes (``split``, ``shard_sizes``, ...) read through."""

    def __init__(self, base: nn.Module, target: LoRATarget, state: LoRAStepState, num_slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.output_slices = tuple(s.size for s in target.slices)
        self.row_parallel = hasattr(base, "full_in_features")
        for i, s in enumerate(target.slices):
            self.register_buffer(f"lora_a_{i}", torch.zeros(num_slots, rank, target.in_size, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"lora_b_{i}", torch.zeros(num_slots, s.size, rank, dtype=dtype, device=device), persistent=False)

    @property
    def a(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_a_{i}") for i in range(len(self.output_slices))]

    @property
    def b(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_b_{i}") for i in range(len(self.output_slices))]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]``: the base layer's output with each token's adapter added."""
        state, base = self.state, self.base
        if not state.enabled:
            return base(x)
        if x.shape[0] < state.tokens.num_tokens:
            raise ValueError(f"LoRA layer {type(base).__name__}: {x.shape[0]} tokens, fewer than the step's "
                             f"{state.tokens.num_tokens} whose slots were set")
        if not self.row_parallel:
            y = base(x)
            state.kernel.add_lora(y, x, self.a, self.b, state.scalings, state.tokens, self.output_slices)
            return y
        y = base.product(x)  # this rank's partial product; the adapter's partial shrink joins it in the all-reduce
        state.kernel.add_lora(y, x, self.a, self.b, state.scalings, state.tokens, self.output_slices)
        y = base.tp.all_reduce(y)
        return y if base.bias is None else y + base.bias


def install(model: nn.Module, targets: dict[str, LoRATarget], state: LoRAStepState, num_slots: int, rank: int,
            dtype: torch.dtype, device: torch.device) -> dict[str, LoRALinear]:
    """Replace each target layer of ``model`` by a :class:`LoRALinear` around it; returns them by name."""
    layers: dict[str, LoRALinear] = {}
    for name, target in targets.items():
        parent = model.get_submodule(target.parent) if target.parent else model
        wrapped = LoRALinear(getattr(parent, target.leaf), target, state, num_slots, rank, dtype, device)
        setattr(parent, target.leaf, wrapped)
        layers[name] = wrapped
    return layers
