"""Which adapter holds which of the ``max_loras`` device slots: the scheduler's bookkeeping, pure Python.

A slot held by a running request's adapter is *pinned* (its count of running users above zero); one
whose users all finished stays *idle* with its adapter's weights in place, so a later request for the
same adapter reuses it without a copy.  An adapter without a slot takes a never-used slot first, then
evicts the least recently idle one.  When every slot is pinned by other adapters, none can be had:
the scheduler then holds the request (and everything behind it) until a slot goes idle, so one
adapter's steady traffic never starves another's.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"lora.max_loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot
        self.adapter_in: list[int] = [0] * num_slots  # slot -> adapter id (0: never used)
        self.users = [0] * num_slots  # slot -> running requests using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # slots with no user and an adapter, least recently idle first
        self._never = list(range(num_slots - 1, -1, -1))  # slots never used, popped from the end

    def available(self, lora_id: int) -> bool:
        """``lora_id`` has a slot or can get one now."""
        return lora_id in self.slot_of or bool(self._never) or bool(self._idle)

    def acquire(self, lora_id: int) -> int | None:
        """One more running user of ``lora_id``: its slot (assigned now if it had none), or ``None`` when
        every slot is pinned by other adapters (nothing changes then)."""
        slot = self.slot_of.get(lora_id)
        if slot is None:
            if self._never:
                slot = self._never.pop()
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                del self.slot_of[self.adapter_in[slot]]
            else:
                return None
            self.slot_of[lora_id], self.adapter_in[slot] = slot, lora_id
        elif self.users[slot] == 0:
            del self._idle[slot]
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A running user of ``slot`` finished or was preempted."""
        if self.users[slot] <= 0:
            raise ValueError(f"LoRA slot {slot} released with no running user")
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None

    def forget(self, lora_id: int) -> bool:
        """Drop ``lora_id``'s slot (the adapter was unloaded); ``False`` while running requests use it."""
        slot = self.slot_of.get(lora_id)
        if slot is None:
            return True
        if self.users[slot]:
            return False
        del self.slot_of[lora_id]
        self._idle.pop(slot, None)
        self.adapter_in[slot] = 0
        self._never.append(slot)
        return True

    @property
    def num_pinned(self) -> int:
        return sum(1 for u in self.users if u)
