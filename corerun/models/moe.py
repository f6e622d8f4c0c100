"""Mixture-of-experts layers: routing, the experts' weights in one stacked tensor per projection, and
the experts kernels.

A token's hidden state ``x`` goes to ``top_k`` of ``E`` experts.  The router scores every expert
(``logits = x @ gate.T``), :func:`route` takes the softmax and the ``top_k`` largest probabilities,
renormalised to sum to one where the family does (Mixtral always; Qwen2-MoE and Qwen3-MoE when
``norm_topk_prob``).  Each expert is a SiLU-gated MLP ``down(silu(gate(x)) * up(x))``; the output is
the routing-weighted sum of the chosen experts' outputs, plus, in Qwen2-MoE, a shared expert scaled
by ``sigmoid(shared_expert_gate(x))``.

The experts kernel (``[T, H]`` states, ``[T, k]`` routing weights and expert ids, the stacked
weights) has two implementations here:

- :func:`experts_reference`: every (token, slot) pair's expert weights gathered, two einsums; plain
  torch and memory-hungry (``T * k * 3 * I * H`` values), for tests;
- :func:`grouped_experts`: the pairs sorted by expert, one dense product per expert over its tokens,
  scattered back with ``index_add_``; what the layer runs on CPU (and for float64 anywhere);
- :func:`corerun.models.moe_triton.triton_experts`: the same grouping in two Triton launches (one
  grouped GEMM per projection, every expert at once, no host sync); what the layer runs on CUDA.

Weights: ``experts.gate_up_proj.weight`` ``[E, 2 * I, H]`` (each expert's gate rows, then its up
rows) and ``experts.down_proj.weight`` ``[E, H, I]``.  Checkpoints store them per expert
(``experts.N.w1/w3/w2`` in Mixtral, ``experts.N.gate_proj/up_proj/down_proj`` in Qwen MoE); the
family's ``packed_modules_mapping`` (:func:`expert_modules_mapping`) sends each to its stacked weight
with shard ``(N, "gate" | "up" | "down")``.
Tensor parallel: every rank holds every expert, with its slice of each expert's intermediate
features (gate and up rows, down columns); the layer sums the ranks' partial outputs once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from corerun.distributed.sharding import shard_range
from corerun.models.config import ModelConfig
from corerun.models.errors import ModelLoadError
from corerun.models.layers import Linear, MergedLinear, RMSNorm, WeightShapeError, as_dense
from corerun.models.llama import ArchOptions, LlamaAttention, LlamaDecoderLayer
from corerun.models.parallel_layers import mlp_projections

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod

EXPERT_SHARDS = ("gate", "up", "down")


@dataclass(frozen=True)
class MoeConfig:
    """A family's experts, read from ``config.json`` by :meth:`read`."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights divided by their sum
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none

    @classmethod
    def read(
        cls, config: ModelConfig, experts_key: tuple[str, ...], size_key: str, renormalize: bool | str,
        shared_key: str | None = None,
    ) -> "MoeConfig":
        """``experts_key``: the keys that may hold the expert count, first found wins; ``renormalize``: a
        constant or the key that says (``norm_topk_prob``, false when absent)."""
        raw = config.raw

        def positive(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
            return value

        key = next((k for k in experts_key if raw.get(k) is not None), None)
        if key is None:
            raise ModelLoadError(f"config.json: {' or '.join(experts_key)} (the number of experts) is missing")
        num = positive(key, raw[key])
        top_k = positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
        if top_k > num:
            raise ModelLoadError(f"config.json: num_experts_per_tok {top_k} is more than the {num} experts ({key})")
        size = positive(size_key, raw.get(size_key, config.intermediate_size))
        shared = positive(shared_key, raw[shared_key]) if shared_key and raw.get(shared_key) else 0
        norm = renormalize if isinstance(renormalize, bool) else bool(raw.get(renormalize, False))
        return cls(num, top_k, size, norm, shared)

    def block(self, hidden_size: int, tp: "TensorParallelGroup | None" = None) -> "SparseMoeBlock":
        return SparseMoeBlock(hidden_size, self.num_experts, self.top_k, self.intermediate_size, self.renormalize,
                              self.shared_intermediate_size, tp)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` ``[T, E]`` -> ``(weights, ids)``, each ``[T, top_k]``, largest probability first.

    The softmax runs in float32 at least (float64 stays float64); ``renormalize`` divides the top-k
    probabilities by their sum.  ``weights`` is in the softmax's dtype.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.promote_types(router_logits.dtype, torch.float32))
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """``x`` ``[T, H]``, ``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, ``weights``/``ids`` ``[T, k]`` -> ``[T, H]``."""
    h = torch.einsum("th,tkoh->tko", x, gate_up[ids])
    gate, up = h.chunk(2, dim=-1)
    out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, down[ids])
    return (out * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """The same product as :func:`experts_reference`, grouped by expert: tokens of one expert in one product."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # (token, slot) pairs, expert by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    pair_weights = weights.reshape(-1).to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // k
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, y * pair_weights[pairs].unsqueeze(-1))
    return out


def cuda_experts_kernel() -> Any:
    """:func:`corerun.models.moe_triton.triton_experts`, or ``None`` where Triton does not import."""
    try:
        from corerun.models.moe_triton import triton_experts
    except ImportError:
        return None
    return triton_experts


def expert_modules_mapping(num_experts: int, names: dict[str, str]) -> dict[str, tuple[str, tuple[int, str]]]:
    """Entries of a family's ``packed_modules_mapping`` for per-expert checkpoint tensors.

    ``names`` maps the checkpoint's per-expert module to its shard (Mixtral: ``{"w1": "gate", "w3": "up",
    "w2": "down"}``); ``experts.N.w1`` then loads into ``experts.gate_up_proj`` as shard ``(N, "gate")``.
    Put these entries before any that match the same module names outside the experts (``gate_proj``).
    """
    where = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}
    return {f"experts.{e}.{name}": (f"experts.{where[shard]}", (e, shard))
            for e in range(num_experts) for name, shard in names.items()}


class StackedWeight(nn.Module):
    """One projection of every expert: ``weight`` ``[E, out, in]``."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features), requires_grad=False)


class FusedExperts(nn.Module):
    """``E`` SiLU-gated experts of intermediate size ``I`` (this rank's ``I / n`` under tensor parallelism).

    ``forward(x, weights, ids)`` returns this rank's partial ``[T, H]`` output (no all-reduce).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: "TensorParallelGroup | None" = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.full_intermediate = num_experts, hidden_size, intermediate_size
        if tp is None:
            self.start, self.size = 0, intermediate_size
        else:
            self.start, self.size = shard_range(intermediate_size, tp.rank, tp.world_size, "moe intermediate_size")
        self.gate_up_proj = StackedWeight(num_experts, 2 * self.size, hidden_size)
        self.down_proj = StackedWeight(num_experts, hidden_size, self.size)
        for param, shards in ((self.gate_up_proj.weight, ("gate", "up")), (self.down_proj.weight, ("down",))):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.shard_ids = tuple((e, s) for e in range(num_experts) for s in shards)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        """One expert's checkpoint tensor: ``shard_id`` ``(expert, "gate" | "up" | "down")``, full size."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_SHARDS
                and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"expert shard must be (expert in 0..{self.num_experts - 1}, one of {EXPERT_SHARDS}), "
                             f"got {shard_id!r}")
        expert, which = shard_id
        h, full = self.hidden_size, self.full_intermediate
        if which == "down":
            expected = (h, full)
            if tuple(loaded_weight.shape) != expected:
                raise WeightShapeError(expected, tuple(loaded_weight.shape))
            param.data[expert].copy_(as_dense(loaded_weight).narrow(1, self.start, self.size))
            return
        expected = (full, h)
        if tuple(loaded_weight.shape) != expected:
            raise WeightShapeError(expected, tuple(loaded_weight.shape))
        offset = 0 if which == "gate" else self.size
        param.data[expert].narrow(0, offset, self.size).copy_(as_dense(loaded_weight).narrow(0, self.start, self.size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, ``weights`` / ``ids`` ``[T, k]`` -> ``[T, H]`` (this rank's part): the Triton kernel
        on CUDA (float16, bfloat16, float32), the grouped torch products elsewhere."""
        kernel = cuda_experts_kernel() if x.is_cuda and x.dtype != torch.float64 else None
        return (kernel or grouped_experts)(x, self.gate_up_proj.weight, self.down_proj.weight, weights, ids)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SiLU-gated MLP every token goes through; ``forward`` returns this
    rank's partial product (the block all-reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: "TensorParallelGroup | None" = None) -> None:
        super().__init__()
        if tp is None:
            self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
            self.down_proj = Linear(intermediate_size, hidden_size)
        else:
            self.gate_up_proj, self.down_proj = mlp_projections(hidden_size, intermediate_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj.product(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """Router ``gate`` ``[E, H]``, ``experts`` and, when ``shared_intermediate_size``, a ``shared_expert``
    with its ``shared_expert_gate`` ``[1, H]``: ``x`` ``[T, H]`` -> ``[T, H]``."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
        shared_intermediate_size: int = 0, tp: "TensorParallelGroup | None" = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts {num_experts}")
        self.top_k, self.renormalize, self.tp = top_k, renormalize, tp
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, tp)
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size, tp)
            self.shared_expert_gate = Linear(hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer whose MLP the family builds (:meth:`make_mlp`: a :class:`SparseMoeBlock` or a
    dense MLP) and keeps under its checkpoint's name (``mlp_attr``), so no dense MLP is allocated first."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, opts, tp, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        setattr(self, self.mlp_attr, self.make_mlp(config, layer_idx, opts, tp, quant))

    def make_mlp(
        self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None",
        quant: "QuantizationMethod | None",
    ) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must build its MLP in make_mlp")
