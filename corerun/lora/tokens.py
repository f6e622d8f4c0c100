"""A step's LoRA bookkeeping, built once per step and handed to every adapted layer's ``add_lora``.

The tokens' slots, and the same tokens ordered by slot with each slot's count and start: what a
kernel that multiplies one slot's tokens at a time needs, computed once per step (from the step's
``lora_slots``, when the runner begins it) rather than in each of the step's layer calls, as vLLM's
punica wrapper computes its metadata once per step.

The device tensors have fixed addresses (sized for the engine's most tokens per step and refilled in
place), so a CUDA graph captured with them replays with each step's values.  The host fields are
counted from the step's slots on the host where the step has them there (CPU), else read from the
device once per step when a kernel first asks; a graph replays them as they were at capture, so only
kernels that are not ``graph_safe`` may read them.

    tokens = LoRATokens.of(token_slots, num_slots=4)      # one call's worth (tests, benchmarks)
    tokens = LoRATokens(num_slots=4, max_tokens=8192, device=device)
    tokens.update(lora_slots)                             # each step: int32 [n], on the host or the device
"""

from __future__ import annotations

import torch


class LoRATokens:
    """One step's tokens for the LoRA kernels (``S`` = ``num_slots``, ``n`` = ``num_tokens``):

    - ``slots``: int32 ``[max_tokens]`` on the device, each token's slot (``-1``: the base model); the
      rows past the step's ``n`` tokens are ``-1`` (a CUDA graph's padding tokens are the base model's);
    - ``order``: int64 ``[max_tokens]`` on the device; ``order[:n]`` are the step's token indices ordered
      by slot (stable: in token order within a slot), the base model's first;
    - ``counts``, ``starts``: int64 ``[S]`` on the device: slot ``s``'s tokens are
      ``order[starts[s] : starts[s] + counts[s]]``;
    - host (not for graph-safe kernels): ``num_tokens`` (``n``), ``num_base`` (tokens of slot ``-1``),
      ``host_counts`` (``S`` ints, ``counts`` as read on the host) and :meth:`host_scalings`.
    """

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device | str) -> None:
        if num_slots < 1 or max_tokens < 1:
            raise ValueError(f"LoRATokens needs num_slots >= 1 and max_tokens >= 1, got {num_slots} and {max_tokens}")
        self.num_slots = num_slots
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.order = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self._counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)  # slot -1, then 0 .. S-1
        self.counts = self._counts[1:]
        self.starts = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.num_tokens = 0
        self._host: list[int] | None = [0] * (num_slots + 1)  # slot -1, then 0 .. S-1, as read on the host
        self._scalings: list[float] | None = None  # the slots' scalings as read on the host this step

    @classmethod
    def of(cls, token_slots: torch.Tensor, num_slots: int) -> "LoRATokens":
        """The bookkeeping of ``token_slots`` (int32 ``[T]``, on the device the kernel runs on) alone."""
        tokens = cls(num_slots, max(1, token_slots.shape[0]), token_slots.device)
        tokens.update(token_slots.cpu())
        return tokens

    def update(self, step_slots: torch.Tensor) -> None:
        """Refill every field, in place, for a step whose tokens have slots ``step_slots`` (int32 ``[n]``,
        ``-1`` the base model): copies and a sort on the device, no synchronisation.  Slots given on the
        host (the CPU's step inputs) are checked and counted there; given on the device (CUDA's), the
        host fields are read from the device when a kernel first asks for them, once per step."""
        n, capacity = step_slots.shape[0], self.slots.shape[0]
        if n > capacity:
            raise ValueError(f"a step of {n} tokens, beyond the {capacity} the LoRA slots were sized for")
        self._host = self._scalings = None
        if step_slots.device.type == "cpu":
            if n and not (-1 <= int(step_slots.min()) and int(step_slots.max()) < self.num_slots):
                raise ValueError(f"token slots must lie in -1 .. {self.num_slots - 1} (the LoRA slots), got "
                                 f"{int(step_slots.min())} .. {int(step_slots.max())}")
            self._host = torch.bincount(step_slots.long() + 1, minlength=self.num_slots + 1).tolist()
        self.slots[:n].copy_(step_slots, non_blocking=True)
        if n < self.num_tokens:
            self.slots[n : self.num_tokens].fill_(-1)
        self.num_tokens = n
        slots = self.slots[:n].long()
        self.order[:n].copy_(torch.argsort(slots, stable=True))
        self._counts.zero_().scatter_add_(0, slots + 1, torch.ones_like(slots))  # (bincount on CUDA reads its size on the host)
        self.starts.copy_(self._counts.cumsum(0)[:-1])

    def _read(self) -> list[int]:
        if self._host is None:
            self._host = self._counts.tolist()  # slots given on the device: one read per step
        return self._host

    def host_scalings(self, scalings: torch.Tensor) -> list[float]:
        """``scalings`` (float32 ``[S]``, the slots' ``alpha / r``) as ``S`` floats (host), read at the
        step's first call and kept until the next :meth:`update`: the slots' adapters (and their
        scalings) are set before a step begins and hold through its layers."""
        if self._scalings is None:
            self._scalings = scalings.tolist()
        return self._scalings

    @property
    def num_base(self) -> int:
        """The step's tokens of slot ``-1`` (host)."""
        return self._read()[0]

    @property
    def host_counts(self) -> tuple[int, ...]:
        """Each slot's token count, ``S`` ints (host)."""
        return tuple(self._read()[1:])
