"""What one step needs on the device besides weights and KV cache, measured by running it.

``kv_cache.num_blocks: auto`` on CUDA gives the KV cache what is left of ``memory_fraction`` of the
device after the weights *and* after room for the largest step: the runner runs the composed model
once on the scheduler's worst prefill (``max_num_batched_tokens`` tokens, in requests of at most
``max_model_len``), computes logits and samples for ``max_num_seqs`` rows, and, when the graph runner
captures, runs a decode of the largest captured batch shaped as the captured one is (block tables as
wide as ``max_model_len``).  The peaks of those runs are kept out of the KV budget: the first two share
torch's caching pool, the last one lives in the graph pool, which nothing else can reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import ModelInputs


@dataclass(frozen=True)
class StepMemory:
    """Peak bytes above what was allocated before each profiled run (0 on devices that are not CUDA)."""

    prefill_bytes: int  # the worst prefill step's forward
    sampling_bytes: int  # logits and sampling of max_num_seqs rows
    graph_bytes: int  # a decode of the largest captured batch (the graph pool); 0 when nothing is captured
    prefill_tokens: int
    prefill_requests: int

    @property
    def reserved_bytes(self) -> int:
        """What the KV budget must leave free: the larger eager peak plus the graph pool."""
        return max(self.prefill_bytes, self.sampling_bytes) + self.graph_bytes


def prefill_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The scheduler's most demanding prefill: the token budget filled by as few requests as possible.

    Each request is at most ``max_model_len`` tokens (a longer one cannot exist) and there are at most
    ``max_num_seqs`` of them.  Few long requests is the worst case for attention backends whose
    prefill work grows with the square of a request's length.
    """
    lengths: list[int] = []
    left = max_num_batched_tokens
    while left > 0 and len(lengths) < max_num_seqs:
        n = min(left, max_model_len)
        lengths.append(n)
        left -= n
    return lengths


def dummy_step(
    query_lens: list[int], block_size: int, device: torch.device, *, table_width: int | None = None,
    max_seq_len: int | None = None,
) -> tuple[ModelInputs, int]:
    """Requests with ``query_lens[i]`` new tokens each and nothing cached, in consecutive blocks from 0.

    Returns the inputs (token ids all 0, positions ``0..n-1`` per request; decodes, those of length 1,
    come first as the runner orders them) and the number of blocks they use.  ``table_width`` widens
    the block tables (padding entries are block 0) and ``max_seq_len`` raises the host bound, to shape
    a decode like a captured one.
    """
    query_lens = sorted(query_lens, key=lambda n: n != 1)
    blocks = [-(-n // block_size) for n in query_lens]
    width = max(max(blocks), table_width or 0)
    first = [sum(blocks[:i]) for i in range(len(blocks))]
    tables = [[first[i] + j for j in range(blocks[i])] + [0] * (width - blocks[i]) for i in range(len(blocks))]
    positions = [p for n in query_lens for p in range(n)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, n in enumerate(query_lens) for p in range(n)]
    qsl = torch.tensor([0] + [sum(query_lens[: i + 1]) for i in range(len(query_lens))], dtype=torch.int32)
    seq_lens = torch.tensor(query_lens, dtype=torch.int32)
    batch = AttentionBatch(
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        context_lens=torch.zeros(len(query_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_reqs=len(query_lens),
        num_tokens=len(positions),
        max_query_len=max(query_lens),
        max_seq_len=max(max(query_lens), max_seq_len or 0),
        num_decodes=sum(1 for n in query_lens if n == 1),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    inputs = ModelInputs(
        input_ids=torch.zeros(len(positions), dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        batch=batch,
    )
    return inputs, sum(blocks)


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Run ``run()``; on CUDA return its peak allocation above what was allocated before (else 0).

    Whatever ``run`` returns is dropped before the measurement ends, so only its transient peak counts.
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
