"""Per-request device copies of token histories, keyed by ``SamplingMetadata.seq_ids``.

A request that uses a penalty gets an entry: its prompt's distinct tokens (the repetition penalty
only asks whether a token is there; kept only when the request has a repetition penalty) and its
output's distinct tokens with their counts (what the frequency and presence penalties need), kept up
to date from the host: each step reads only the output tokens beyond the entry's length, bumps their
counts in a host dict and writes the changed slots.  So the host work of a step follows the batch size
and the new tokens, not the history, and the device work follows the distinct tokens, with no sort.

An entry is rebuilt from the lists when they disagree with it (another prompt length, an output
shorter than the entry, another token at the entry's last position, a prompt now needed).  It lives
until its request finishes (:meth:`HistoryCache.forget`, from ``SamplingMetadata.finished_seq_ids``):
a request absent from a step (not scheduled, preempted, a prompt chunk) keeps it, and takes in only
its new tokens when it comes back.  For callers that never report finished requests, an entry unused
for ``IDLE_SYNCS`` to twice that many steps is dropped (rebuilt if its request comes back).

All entries live in one int64 ``[2, capacity]`` device tensor (an arena): row 0 holds tokens, row 1
the counts of output tokens.  A request owns a region for its prompt and one for its output with room
to grow (the room doubles when outgrown, so moves are amortised).  A step's writes, a step's reads
and a compaction are each one scatter or gather over index ranges built on the device, so a step
launches the same few kernels whatever the batch, and never waits on the device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from corerun.sdk.sampling import to_device
from corerun.sampler._device import ranges
from corerun.sampler.histories import Histories, ListHistories

MIN_ARENA = 1 << 14  # positions
MIN_ROOM = 64  # distinct output tokens a new entry has room for before its first move
IDLE_SYNCS = 1024  # steps an entry may go unused before a sweep drops it (callers that report no finishes)
TOKENS, COUNTS = 0, 1  # the arena's rows


@dataclass(slots=True)
class _Entry:
    """One request's regions of the arena and what the host knows of them."""

    prompt_len: int  # len(prompt) the entry was built from
    has_prompt: bool
    prompt_start: int  # distinct prompt tokens at [prompt_start, prompt_start + prompt_count)
    prompt_count: int
    out_start: int  # distinct output tokens and counts at [out_start, out_start + len(count)), room for out_cap
    out_cap: int
    out_len: int  # output tokens taken in (with repeats)
    last: int  # output[out_len - 1], or -1 when the output is empty
    slot: dict[int, int] = field(default_factory=dict)  # distinct output token -> its offset in the region
    count: list[int] = field(default_factory=list)  # the count of the token at each offset
    seen: int = 0  # the last sync that used the entry

    def stale(self, prompt: Sequence[int], output: Sequence[int], need_prompt: bool) -> bool:
        """Whether the step's lists disagree with what the entry holds (O(1) checks)."""
        return (
            self.prompt_len != len(prompt)
            or self.out_len > len(output)
            or (need_prompt and not self.has_prompt)
            or (self.out_len > 0 and output[self.out_len - 1] != self.last)
        )


class HistoryCache:
    """Device copies of the histories of the requests that use penalties; see the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._data: torch.Tensor | None = None  # int64 [2, capacity]
        self._top = 0  # first unused position of the arena
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])  # flat starts, lengths, values
        self._syncs = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def sync(
        self,
        seq_ids: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        rows: Sequence[int],
        prompt_rows: Sequence[int],
        device: torch.device,
    ) -> Histories:
        """Bring the entries of ``rows`` up to date with the lists (``prompt_rows``: the rows whose prompt
        is needed too) and return the step's histories served from the arena.  Entries of other
        requests are kept (see :meth:`forget`).

        A step that names one ``seq_id`` on two rows is served from the lists and leaves the cache alone.
        """
        if len(set(seq_ids)) != len(seq_ids):
            return ListHistories(prompt_token_ids, output_token_ids)
        if self._data is not None and self._data.device != device:
            self.clear()
        self._syncs = now = self._syncs + 1
        if now % IDLE_SYNCS == 0:  # unused since the previous sweep: a request nobody said finished
            self.forget([s for s, e in self._entries.items() if e.seen <= now - IDLE_SYNCS])
        need_prompt = set(prompt_rows)
        by_row: dict[int, _Entry] = {}
        try:
            for i in rows:
                prompt, output = prompt_token_ids[i], output_token_ids[i]
                entry = self._entries.get(seq_ids[i])
                if entry is None or entry.stale(prompt, output, i in need_prompt):
                    entry = self._build(seq_ids[i], prompt, output, i in need_prompt, device)
                elif len(output) > entry.out_len:
                    self._append(entry, output, device)
                entry.seen = now
                by_row[i] = entry
            self._flush()
        except BaseException:
            self.clear()  # half-applied writes: start again from the lists next step
            raise
        return _CachedHistories(self, by_row)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the entries of ``seq_ids`` (finished requests; unknown ids are ignored).  Their regions
        are reclaimed by the next compaction; with no entry left the arena starts over."""
        for seq_id in seq_ids:
            self._entries.pop(seq_id, None)
        if not self._entries:
            self._top = 0

    def clear(self) -> None:
        """Forget every entry (the arena's memory is released too)."""
        self._entries.clear()
        self._data, self._top = None, 0
        self._pending = ([], [], [])

    # ------------------------------------------------------------------ entries
    def _build(self, seq_id: int, prompt: Sequence[int], output: Sequence[int], need_prompt: bool, device: torch.device) -> _Entry:
        self._entries.pop(seq_id, None)  # a stale entry's regions are left for compaction
        distinct = list(set(prompt)) if need_prompt else []
        tokens = list(output)
        counts = Counter(tokens)
        cap = max(2 * len(counts), MIN_ROOM)
        start = self._reserve(len(distinct) + cap, device)
        entry = _Entry(
            prompt_len=len(prompt), has_prompt=need_prompt, prompt_start=start, prompt_count=len(distinct),
            out_start=start + len(distinct), out_cap=cap, out_len=len(tokens), last=tokens[-1] if tokens else -1,
            slot={t: j for j, t in enumerate(counts)}, count=list(counts.values()),
        )
        self._entries[seq_id] = entry
        self._write(TOKENS, start, distinct + list(counts))
        self._write(COUNTS, entry.out_start, entry.count)
        return entry

    def _append(self, entry: _Entry, output: Sequence[int], device: torch.device) -> None:
        n = len(output)
        new = [output[j] for j in range(entry.out_len, n)]  # only the new tokens, however ``output`` slices
        fresh = [t for t in dict.fromkeys(new) if t not in entry.slot]
        used = len(entry.count)
        if used + len(fresh) > entry.out_cap:
            cap = max(2 * entry.out_cap, used + len(fresh))
            start = self._reserve(cap, device)  # may compact, which moves ``entry`` first
            data = self._data
            data[:, start : start + used] = data[:, entry.out_start : entry.out_start + used]
            entry.out_start, entry.out_cap = start, cap
        touched: dict[int, None] = {}
        for t in new:
            j = entry.slot.get(t)
            if j is None:
                j = entry.slot[t] = len(entry.count)
                entry.count.append(0)
            entry.count[j] += 1
            touched[j] = None
        self._write(TOKENS, entry.out_start + used, fresh)  # the fresh tokens took offsets used, used + 1, ...
        for j in touched:
            self._write(COUNTS, entry.out_start + j, [entry.count[j]])
        entry.out_len, entry.last = n, new[-1]

    # ------------------------------------------------------------------ arena
    def _write(self, row: int, start: int, values: list[int]) -> None:
        """Queue ``values`` for ``[start, start + len(values))`` of arena row ``row`` (until ``_flush``)."""
        if values:
            starts, lengths, flat = self._pending
            starts.append(row * self._data.shape[1] + start)
            lengths.append(len(values))
            flat.extend(values)

    def _flush(self) -> None:
        """The queued writes as one upload and one scatter (their positions never repeat)."""
        starts, lengths, values = self._pending
        if not values:
            return
        s = len(starts)
        packed = to_device(starts + lengths + values, torch.int64, self._data.device)
        index, _ = ranges(packed[:s], packed[s : 2 * s], len(values))
        self._data.view(-1).index_copy_(0, index, packed[2 * s :])
        self._pending = ([], [], [])

    def _reserve(self, n: int, device: torch.device) -> int:
        """``n`` free positions at the top of the arena, compacting or growing it first if needed."""
        capacity = 0 if self._data is None else self._data.shape[1]
        if self._top + n > capacity:
            self._flush()
            live = sum(e.prompt_count + e.out_cap for e in self._entries.values())
            self._compact(max(capacity, MIN_ARENA, 2 * (live + n)), device)
        start = self._top
        self._top += n
        return start

    def _compact(self, capacity: int, device: torch.device) -> None:
        """Move every entry, packed, into a new arena of ``capacity`` positions (one gather, one scatter)."""
        fresh = torch.empty(2, capacity, dtype=torch.int64, device=device)
        src, dst, lengths, top = [], [], [], 0
        for e in self._entries.values():
            src += [e.prompt_start, e.out_start]
            dst += [top, top + e.prompt_count]
            lengths += [e.prompt_count, len(e.count)]
            e.prompt_start, e.out_start = top, top + e.prompt_count
            top += e.prompt_count + e.out_cap
        total = sum(lengths)
        if total:
            s = len(src)
            packed = to_device(src + dst + lengths, torch.int64, device)
            from_index, _ = ranges(packed[:s], packed[2 * s :], total)
            to_index, _ = ranges(packed[s : 2 * s], packed[2 * s :], total)
            fresh.index_copy_(1, to_index, self._data.index_select(1, from_index))
        self._data, self._top = fresh, top


class _CachedHistories:
    """One step's histories, read from the arena of a synced :class:`HistoryCache`."""

    def __init__(self, cache: HistoryCache, by_row: dict[int, _Entry]) -> None:
        self._cache, self._by_row = cache, by_row

    def _gather(self, rows: Sequence[int], with_prompt: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(arena positions int64 ``[H]``, their row int64 ``[H]``) of the rows' regions; None when empty."""
        starts, lengths, owners = [], [], []
        for i in rows:
            e = self._by_row[i]
            for start, length in ((e.prompt_start, e.prompt_count if with_prompt else 0), (e.out_start, len(e.count))):
                if length:
                    starts.append(start)
                    lengths.append(length)
                    owners.append(i)
        total = sum(lengths)
        if not total:
            return None
        s = len(starts)
        packed = to_device(starts + lengths + owners, torch.int64, device)
        index, seg = ranges(packed[:s], packed[s : 2 * s], total)
        return index, packed[2 * s :].index_select(0, seg)

    def seen(self, rows: Sequence[int], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._gather(rows, True, device)
        if found is None:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return empty, empty
        index, row_ids = found
        return row_ids * vocab_size + self._cache._data[TOKENS].index_select(0, index), row_ids

    def counted(
        self, rows: Sequence[int], vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        found = self._gather(rows, False, device)
        if found is None:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return empty, empty, empty
        index, row_ids = found
        pair = self._cache._data.index_select(1, index)  # [2, H]: tokens, counts
        return row_ids * vocab_size + pair[TOKENS], row_ids, pair[COUNTS]
