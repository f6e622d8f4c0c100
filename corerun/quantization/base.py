"""The quantization method protocol: how a linear layer's weight is stored, loaded and applied.

A method is built once per model (``factory(**options)``) and handed to every linear layer of it
(:class:`corerun.models.layers.Linear` and its merged and tensor-parallel kinds).  The layer owns
the geometry (its shards, its rank's slice) and the bias; the method owns the weight:

1. ``create_weights(layer, in_features, shard_sizes)`` registers the weight's storage on ``layer``.
   ``shard_sizes`` maps each shard id to its output rows, in order (``{"q": Hq*D, "k": Hkv*D,
   "v": Hkv*D}``, ``{"gate": I, "up": I}``, ``{None: out_features}`` for a plain layer).  The layer
   then attaches its own ``weight_loader`` to ``layer.weight``, which must exist (a placeholder is
   fine when the storage lives elsewhere) so that the model loader finds it by name.
2. ``load_weight(layer, loaded, shard_id)``: ``loaded`` is this rank's part of one checkpoint tensor
   already cut by the layer (rows of its shard, columns of its input slice), logically
   ``[shard_sizes[shard_id], in_features]``: a float ``torch.Tensor``, or a packed tensor such as
   :class:`~corerun.quantization.gguf_tensor.GGUFTensor` (``shape``, ``narrow``, ``dequantize()``).
   Errors name the checkpoint tensor and its type.
3. ``apply(layer, x)``: ``x`` ``[T, in_features]`` in an activation dtype -> ``[T, out_features]``
   (shards stacked in order), bias not added (the layer adds it).

Optional: ``checkpoint_weights(weights, quantization_config)`` sees the checkpoint's ``(name, tensor)``
stream first (with ``config.json``'s ``quantization_config``, ``None`` when absent) and returns the one
the loader reads: a format that stores a layer's weight as several tensors (GPTQ's ``qweight``,
``qzeros``, ``scales``) yields them as one packed tensor under the layer's ``weight`` name
(:mod:`corerun.quantization.readers`).  The default passes the stream through.

Optional: ``lm_head(loaded)`` (with ``quantizes_lm_head = True``): a layer that multiplies the LM head
from the checkpoint's tensor for it as read (``lm_head.weight``, or the tied embedding's
``model.embed_tokens.weight``; packed or float, ``[vocab, hidden]``), used by the model's
:class:`~corerun.models.layers.LMHead` in place of its float weight; ``None`` keeps the float head.
Called once after loading, for a model on one rank.

Optional: ``parallel_tokens``, read once the model is loaded: the step size in tokens from which the method's
products run faster on every thread than on one (a kernel that splits one token's rows over the threads: 1).
``threads: auto`` runs a step that large on every thread, or from the dtype's own size if that is smaller
(:func:`corerun.platform.host.parallel_tokens`).  ``None`` (the default) keeps the dtype's.

``capabilities`` (:class:`~corerun.plugin.capabilities.QuantizationCapabilities`) say what it reads and
where it runs; ``quantization: auto`` picks from the checkpoint (:func:`corerun.quantization.select`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Hashable, Iterable, Iterator, Mapping

import torch
from torch import nn

from corerun.plugin.capabilities import QuantizationCapabilities


class QuantizationMethod(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[QuantizationCapabilities]
    dense: ClassVar[bool] = False  # True: the layers keep their plain float path (no per-call dispatch)
    quantizes_lm_head: ClassVar[bool] = False  # True: the loader offers the LM head's tensor to lm_head()
    # from how many tokens a step's products gain from every thread, once the layers are made (None: the dtype's
    # rule, corerun.platform.host.parallel_tokens; the smaller of the two is taken under threads: auto)
    parallel_tokens: int | None = None

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Mapping[Hashable, int]) -> None: ...

    @abstractmethod
    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, Any]], quantization_config: Mapping[str, Any] | None,
    ) -> Iterator[tuple[str, Any]]:
        return iter(weights)

    def lm_head(self, loaded: Any) -> nn.Module | None:
        """A layer ``[T, hidden] -> [T, vocab]`` multiplying the LM head from ``loaded``, or ``None`` for the float head."""
        return None


def shard_offsets(shard_sizes: Mapping[Hashable, int]) -> dict[Hashable, int]:
    """Each shard's first output row, in ``shard_sizes`` order."""
    offsets, at = {}, 0
    for shard_id, size in shard_sizes.items():
        offsets[shard_id], at = at, at + size
    return offsets
