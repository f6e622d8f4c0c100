"""What a model's attention layers are handed on each forward pass (explicitly, never through a global).

Under ``torch.compile`` (the ``compile`` graph runner, :mod:`corerun.graph.compiled`) the attention
call is kept out of the compiled graph: :meth:`AttentionContext.attend` becomes the opaque operator
``corerun::attention``, which the compiler neither traces nor fuses across.  The operator cannot take
the backend's metadata (a Python object) as an argument, so the compile runner binds the step's
backend and metadata with :func:`compiled_step` around the compiled call, and the operator reads
them there.  Eager runs never read that binding.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from corerun.protocols.attention import AttentionBackend


@dataclass
class AttentionContext:
    """``backend`` runs every layer; ``metadata`` is ``backend.plan(batch)`` for this step;
    ``kv_caches[i]`` is layer ``i``'s cache in the backend's own layout; ``per_layer``: the backend is told
    the layer (:func:`wants_layer`; ``None``: read from the backend here, once per context)."""

    backend: AttentionBackend
    metadata: Any
    kv_caches: list[torch.Tensor]
    per_layer: bool | None = None

    def __post_init__(self) -> None:
        if self.per_layer is None:
            self.per_layer = wants_layer(self.backend)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``; writes this step's K/V first.

        The backend is told the layer (``layer=``) only when some layer has a sliding window
        (``spec.per_layer``), so backends without per-layer attention keep their signature."""
        if torch.compiler.is_compiling():
            return torch.ops.corerun.attention(q, k, v, self.kv_caches[layer_idx], layer_idx)
        if self.per_layer:
            return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.metadata, layer=layer_idx)
        return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.metadata)


def wants_layer(backend: AttentionBackend) -> bool:
    """Some layer of ``backend``'s spec has a sliding window (``spec.per_layer``): ``forward`` takes ``layer=``."""
    return bool(getattr(getattr(backend, "spec", None), "per_layer", False))


class _CompiledStep(threading.local):
    backend: AttentionBackend | None = None
    metadata: Any = None


_compiled_step = _CompiledStep()


@contextmanager
def compiled_step(backend: AttentionBackend, metadata: Any) -> Iterator[None]:
    """Bind the step's backend and metadata for ``corerun::attention`` while a compiled model runs (this thread only)."""
    _compiled_step.backend, _compiled_step.metadata = backend, metadata
    try:
        yield
    finally:
        _compiled_step.backend = _compiled_step.metadata = None


# The KV cache is written inside the operator although it is not declared mutated: nothing else in
# the compiled graph reads it, and each layer's call depends on the previous layer's output, so the
# compiler can neither reorder nor drop a call.  Declaring it would make the compiler functionalise
# the write, which can copy the whole cache.
@torch.library.custom_op("corerun::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int = 0) -> torch.Tensor:
    step = _compiled_step
    if step.backend is None:
        raise RuntimeError("corerun::attention ran outside a compiled step (no compiled_step binding)")
    if wants_layer(step.backend):
        return step.backend.forward(q, k, v, kv_cache, step.metadata, layer=layer)
    return step.backend.forward(q, k, v, kv_cache, step.metadata)


@_attention.register_fake
def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int = 0) -> torch.Tensor:
    return q.new_empty(q.shape)
