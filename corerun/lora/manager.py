"""The runner's side of multi-LoRA serving: adapters in a host cache, copied into the device slots the
scheduler hands out, and each step's token slots where the model's LoRA layers read them.

- :meth:`LoRAManager.load`: read and check an adapter (:func:`corerun.lora.peft.load_adapter`) into
  the host cache, ``max_cpu_loras`` adapters kept, least recently used dropped first (a dropped one is
  read again from its folder when next needed);
- :meth:`LoRAManager.begin_step`: the step's new requests name their adapter and slot
  (``NewRequest.lora`` / ``lora_slot``); an adapter not already in its slot is copied there (rank
  zero-padded to ``max_lora_rank``, slices it does not target zeroed), then the step's ``lora_slots``
  field fills the step's :class:`~corerun.lora.tokens.LoRATokens` the layers read (the slots, and the
  tokens ordered by slot with each slot's count: once per step, not per layer).  Both run on the
  thread that runs the forward, in stream order with it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Iterable

import torch
from torch import nn

from corerun.lora.layers import LoRALinear, LoRAStepState, install, lora_targets
from corerun.lora.peft import LoRAError, LoRAWeights, load_adapter
from corerun.lora.request import LoRARequest
from corerun.protocols.lora import LoRAKernel

logger = logging.getLogger("corerun.lora")


class LoRAManager:
    def __init__(self, model: nn.Module, kernel: LoRAKernel, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.targets = lora_targets(model)
        if not self.targets:
            raise LoRAError(f"{type(model).__name__} has no linear layers adapters could target")
        self.state = LoRAStepState(kernel, max_loras, max_tokens, device)
        self.layers: dict[str, LoRALinear] = install(model, self.targets, self.state, max_loras, max_lora_rank, dtype, device)
        self.in_slot: list[int] = [0] * max_loras  # slot -> adapter id whose weights it holds (0: none)
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()  # adapter id -> weights, least recently used first
        self._host_lock = threading.Lock()  # (the server adds adapters while the step thread activates others)
        logger.info("lora: %d layers adapted, %d slots of rank %d: %.1f MiB on %s; kernel %r", len(self.layers),
                    max_loras, max_lora_rank, self.slot_bytes() / 2**20, device, getattr(kernel, "name", type(kernel).__name__))

    def slot_bytes(self) -> int:
        """Device memory the slots take (every layer's A and B stacks)."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (*layer.a, *layer.b))

    # ------------------------------------------------------------ host cache
    def load(self, request: LoRARequest) -> LoRAWeights:
        """``request``'s adapter, from the host cache or read and checked now (raises :class:`LoRAError`)."""
        with self._host_lock:
            return self._load(request)

    def _load(self, request: LoRARequest) -> LoRAWeights:
        cached = self._host.get(request.lora_int_id)
        if cached is not None and cached.request == request:
            self._host.move_to_end(request.lora_int_id)
            return cached
        if cached is not None:
            raise LoRAError(
                f"adapter id {request.lora_int_id} is already loaded as {cached.request.lora_name!r} from "
                f"{cached.request.lora_path!r}; give {request.lora_name!r} ({request.lora_path!r}) another lora_int_id"
            )
        weights = load_adapter(request, self.targets, self.max_lora_rank)
        self._host[request.lora_int_id] = weights
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return weights

    def remove(self, lora_id: int) -> None:
        """Forget ``lora_id`` (unloaded): its host copy and its device slot's claim to it."""
        with self._host_lock:
            self._host.pop(lora_id, None)
        self.in_slot = [0 if i == lora_id else i for i in self.in_slot]

    # ------------------------------------------------------------ device slots
    @torch.no_grad()
    def activate(self, request: LoRARequest, slot: int) -> None:
        """Copy ``request``'s adapter into ``slot`` unless it is there already."""
        if self.in_slot[slot] == request.lora_int_id:
            return
        weights = self.load(request)
        for name, layer in self.layers.items():
            pairs = weights.layers.get(name) or [None] * len(layer.output_slices)
            for a_stack, b_stack, pair in zip(layer.a, layer.b, pairs):
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                if pair is not None:
                    a, b = pair
                    a_stack[slot, : a.shape[0]].copy_(a)
                    b_stack[slot, :, : b.shape[1]].copy_(b)
        self.state.scalings[slot] = weights.scaling
        self.in_slot[slot] = request.lora_int_id

    def begin_step(self, new_reqs: Iterable[Any], lora_slots: torch.Tensor) -> None:
        """Before a forward: the new requests' adapters in their slots, the step's token slots in place."""
        for r in new_reqs:
            if r.lora is not None:
                self.activate(r.lora, r.lora_slot)
        self.state.tokens.update(lora_slots)
