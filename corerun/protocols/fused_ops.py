"""The ``FusedOps`` protocol: the model's elementwise layers (RMSNorm, SiLU-and-mul, RoPE) as one call each.

Each op is several torch passes with float32 temporaries in plain torch; a fused kernel reads its input
once, computes in float32 and rounds once.  The runner selects one implementation per engine
(``fused_ops: auto``) and hands it to the model's ``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding``
layers (their ``ops``); a layer whose ``ops`` is ``None`` runs its own torch code, which is also the
built-in ``torch`` implementation (:mod:`corerun.models.fused_ops`), the reference.  Gemma's
``(1 + weight)`` norms and GeGLU keep their own torch code.

``add_rms_norm`` (the residual add and the next norm in one pass, vLLM's ``fused_add_rms_norm``) is
optional (:class:`FusedAddRMSNorm`): the runner checks for it once, and hands an implementation without
it only the three ops; the layers then add the residual in torch and call its ``rms_norm``.

An implementation is a ``fused_ops`` plugin (``corerun new fused_ops NAME``, ``corerun conformance
fused_ops:NAME``, hook ``corerun_fused_ops``).  This module imports no torch at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from corerun.plugin.capabilities import FusedOpsCapabilities  # noqa: F401 (re-exported: defined beside the other capabilities, importable without torch)

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class FusedOpsNeed:
    """What the engine asks of an implementation: where the model runs and its dtype."""

    device: Any  # a torch.device or a device type ("cuda:0", "cpu")
    dtype: str = "float32"


@runtime_checkable
class FusedOps(Protocol):
    """Factory: ``factory(**options)``. Every method returns a NEW tensor and leaves its inputs unchanged."""

    name: ClassVar[str]
    capabilities: FusedOpsCapabilities  # devices (e.g. ("cpu",)), dtypes (e.g. ("float32", "bfloat16"))

    def rms_norm(self, x: "Tensor", weight: "Tensor", eps: float) -> "Tensor":
        """x [..., H] (last dim contiguous; leading dims may be strided), weight [H] of x's dtype ->
        contiguous [..., H] of x's dtype: x / sqrt(mean(x**2, -1) + eps) * weight, in float32, rounded once."""
        ...

    def silu_and_mul(self, x: "Tensor") -> "Tensor":
        """x [T, 2I] (rows may be strided, last dim contiguous) -> contiguous [T, I] of x's dtype:
        silu(x[:, :I]) * x[:, I:], in float32, rounded once."""
        ...

    def rotary(self, x: "Tensor", cos: "Tensor", sin: "Tensor") -> "Tensor":
        """x [T, H, D] (last dim contiguous; heads and tokens may be strided, e.g. a view of a fused qkv
        output), cos = [c | c] and sin = [-s | s] float32 [T, 1, D] (contiguous) -> contiguous [T, H, D]
        of x's dtype: [x1 c - x2 s | x2 c + x1 s] for x = [x1 | x2] (the "rotate half" layout), in
        float32, rounded once."""
        ...


@runtime_checkable
class FusedAddRMSNorm(Protocol):
    """The optional fourth op of a :class:`FusedOps`: a decoder layer's residual add and the next RMSNorm."""

    def add_rms_norm(self, x: "Tensor", residual: "Tensor", weight: "Tensor", eps: float) -> tuple["Tensor", "Tensor"]:
        """x and residual [T, H] of one dtype (last dim contiguous; rows may be strided), weight [H] of that
        dtype -> (normed, new_residual), two new contiguous [T, H] of x's dtype: new_residual = x + residual
        rounded once to the dtype, normed = new_residual / sqrt(mean(new_residual**2, -1) + eps) * weight
        computed in float32 from that rounded sum (what the add and ``rms_norm`` one after the other give)."""
        ...
