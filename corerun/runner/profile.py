"""What one step needs on the device besides weights and KV cache, measured by running it.

``kv_cache.num_blocks: auto`` on CUDA gives the KV cache what is left of ``memory_fraction`` of the
device after the weights *and* after room for the largest step.  Before the cache exists the runner
runs the composed model on a one-block scratch cache for each step shape that can need the most
memory, and keeps their peaks out of the KV budget:

- the worst prefill: ``max_num_batched_tokens`` tokens in as few requests as possible (each at most
  ``max_model_len``), each the last chunk of a ``max_model_len``-token prompt, so its queries attend
  over the longest possible context;
- the worst eager decode: ``max_num_seqs`` requests (at most ``max_num_batched_tokens``) each at
  ``max_model_len`` tokens;
- sampling: logits and one sampler call for ``max_num_seqs`` rows, with every parameter the sampler
  accepts switched on;
- when the graph runner captures, the largest captured decode, built from the same static inputs
  the capture uses (``corerun.graph.static_inputs``), so the backend plans it exactly as at capture.

The dummy steps are about shapes, not values: every block-table entry is block 0 of the scratch
cache, and every new token is written there.  The first three peaks share torch's caching pool (the
reserve takes the largest); the captured decode lives in the graph pool, which nothing else reuses,
so it is added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from corerun.protocols.graph import GraphLimits, ModelInputs
from corerun.protocols.step_layout import requests_step


@dataclass(frozen=True)
class StepMemory:
    """Peak bytes above what was allocated before each profiled run (0 on devices that are not CUDA)."""

    prefill_bytes: int  # the worst prefill step's forward
    decode_bytes: int  # the widest eager decode step's forward
    sampling_bytes: int  # logits and sampling of max_num_seqs rows
    graph_bytes: int  # the largest captured decode (the graph pool); 0 when nothing is captured
    prefill_tokens: int
    prefill_requests: int
    decode_requests: int
    high_water_bytes: int = 0  # the device's high-water mark before the profile's resets (what a meter would lose)

    @property
    def reserved_bytes(self) -> int:
        """What the KV budget must leave free: the largest eager peak plus the graph pool."""
        return max(self.prefill_bytes, self.decode_bytes, self.sampling_bytes) + self.graph_bytes


def prefill_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The scheduler's most demanding prefill: the token budget filled by as few requests as possible.

    Each request is at most ``max_model_len`` tokens (a longer one cannot exist) and there are at most
    ``max_num_seqs`` of them.  Few long requests is the worst case for attention backends whose
    prefill work grows with a request's length times its context.
    """
    lengths: list[int] = []
    left = max_num_batched_tokens
    while left > 0 and len(lengths) < max_num_seqs:
        n = min(left, max_model_len)
        lengths.append(n)
        left -= n
    return lengths


def dummy_step(query_lens: list[int], context_lens: list[int], block_size: int, device: torch.device) -> ModelInputs:
    """A step of requests with ``query_lens[i]`` new tokens after ``context_lens[i]`` cached ones.

    Shapes only: every block-table entry is block 0 and every new token's slot is in block 0 (a
    one-block scratch cache serves it); token ids are 0, positions run from each context length.
    Requests with one new token (decodes) must come first, as the runner orders them.
    """
    if len(query_lens) != len(context_lens) or not query_lens:
        raise ValueError(f"need one context length per request, got {len(query_lens)} and {len(context_lens)}")
    width = max(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens))
    return requests_step(context_lens, query_lens, [[0] * width] * len(query_lens), block_size, device)


def worst_prefill(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int, device: torch.device) -> ModelInputs:
    """The prefill of :func:`prefill_lengths`, each request the last chunk of a ``max_model_len`` prompt."""
    lengths = prefill_lengths(max_num_batched_tokens, max_model_len, max_num_seqs)
    lengths.sort(key=lambda n: n != 1)  # a 1-token remainder is a decode-shaped row: first
    return dummy_step(lengths, [max_model_len - n for n in lengths], block_size, device)


def widest_decode(num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> ModelInputs:
    """An eager decode of ``num_reqs`` requests, each reaching ``max_model_len`` tokens."""
    return dummy_step([1] * num_reqs, [max_model_len - 1] * num_reqs, block_size, device)


def captured_decode(limits: GraphLimits) -> ModelInputs:
    """The decode of the largest bucket exactly as the ``cuda`` runner captures it: its static
    inputs (all padding rows) as :meth:`~corerun.graph.static_inputs.StaticDecodeInputs.inputs`
    views them (``max_seq_len = max_model_len``, no host copies)."""
    from corerun.graph.static_inputs import StaticDecodeInputs

    return StaticDecodeInputs(limits).inputs(limits.max_batch_size)


def high_water(device: torch.device) -> int:
    """The device's allocation high-water mark now (0 off CUDA): read before each reset, so the profile can
    report the peak an outer measurement (the bench's peak-memory meter) would otherwise lose."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Run ``run()``; on CUDA return its peak allocation above what was allocated before (else 0).

    Whatever ``run`` returns is dropped before the measurement ends, so only its transient peak counts.
    The device's high-water mark is reset for the measurement (read :func:`high_water` first to keep it).
    """
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)
