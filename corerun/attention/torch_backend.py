"""The ``torch`` reference attention backend: paged attention in plain torch, on CPU and CUDA.

Correct before fast, but vectorised: all decodes of a step in one batched gather + matmul, prefill
chunks one request at a time (never a loop over tokens).  It runs in float64 too, which makes it a
convenient oracle, and its pure-decode path is CUDA-graph safe (no host syncs, no data-dependent
shapes: the gather length is the host bound ``batch.max_seq_len``).

Sliding windows (per layer, ``spec.sliding_window(layer)``) and soft-capping (``spec.logits_soft_cap``)
are masks and a ``tanh`` on the scores: a windowed layer still gathers the whole context, so it is
exact at any length but costs what a full layer costs.

Cache layout: one tensor per layer, ``[2, num_blocks + 1, block_size, num_kv_heads, head_size]``
(K then V); with a quantized ``spec.kv_cache_dtype`` its element type, and for int8 each row longer by
its scale (:mod:`corerun.protocols.kv_quant`): rows are quantized on write and dequantized after the gather.  The extra last block is a write-off area: new tokens with slot ``-1`` are written there
instead of being skipped with a data-dependent mask, so the write needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from corerun.attention.capabilities import CAPABILITIES
from corerun.plugin.capabilities import AttentionCapabilities
from corerun.protocols import kv_quant
from corerun.errors import UnsupportedError
from corerun.protocols.attention import AttentionBatch, AttentionSpec



@dataclass
class TorchAttentionMetadata:
    batch: AttentionBatch
    decode_len: int  # keys gathered per decode row (host bound on the decodes' seq_lens)
    # (request index, first query token, query len, context len) of every non-decode request
    prefills: list[tuple[int, int, int, int]]


class TorchAttentionBackend:
    name: ClassVar[str] = "torch"
    capabilities: ClassVar[AttentionCapabilities] = CAPABILITIES

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.capabilities.check(spec)
        if reasons:
            raise UnsupportedError("attention backend 'torch'", reasons)
        self.spec = spec
        # float32 accumulation for half types, float64 when asked for float64
        self.compute_dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32

    # ------------------------------------------------------------------ cache
    def kv_cache_bytes_per_block(self) -> int:
        return self.spec.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        s = self.spec
        shape = (2, num_blocks + 1, s.block_size, s.num_kv_heads, kv_quant.row_size(s))  # + the write-off block
        return torch.empty(shape, dtype=kv_quant.storage_dtype(s), device=s.device)

    def kv_cache_view(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = kv_quant.values_view(kv_cache, self.spec)
        return values[0, :-1], values[1, :-1]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _, nb1, bs, h, d = kv_cache.shape
        flat = kv_cache.view(2, nb1 * bs, h, d)
        trash = (nb1 - 1) * bs  # first slot of the write-off block
        slots = torch.where(slot_mapping < 0, trash, slot_mapping)
        if kv_quant.is_quantized(self.spec):  # index_copy_ has no fp8 kernels: copy the bytes
            flat = flat.view(torch.uint8)
            key = kv_quant.quantize(key, self.spec, 0).view(torch.uint8)
            value = kv_quant.quantize(value, self.spec, 1).view(torch.uint8)
        flat[0].index_copy_(0, slots, key.to(flat.dtype))
        flat[1].index_copy_(0, slots, value.to(flat.dtype))

    # ------------------------------------------------------------------- plan
    def plan(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        nd = batch.num_decodes
        if batch.seq_lens_cpu is not None and nd > 0:
            decode_len = int(batch.seq_lens_cpu[:nd].max())
        else:
            decode_len = batch.max_seq_len
        prefills: list[tuple[int, int, int, int]] = []
        if nd < batch.num_reqs:
            if batch.query_start_loc_cpu is None or batch.seq_lens_cpu is None:
                raise ValueError("torch attention: a batch with prefills needs query_start_loc_cpu and seq_lens_cpu")
            qsl = batch.query_start_loc_cpu.tolist()
            sl = batch.seq_lens_cpu.tolist()
            for i in range(nd, batch.num_reqs):
                qlen = qsl[i + 1] - qsl[i]
                prefills.append((i, qsl[i], qlen, sl[i] - qlen))
        return TorchAttentionMetadata(batch, decode_len, prefills)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        out: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> torch.Tensor:
        batch = metadata.batch
        window = self.spec.sliding_window(layer)
        self.write_kv(key, value, kv_cache, batch.slot_mapping)
        if out is None:
            out = torch.empty_like(query)
        nd = batch.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, batch, nd, metadata.decode_len, window)
        for req, start, qlen, ctx in metadata.prefills:
            out[start : start + qlen] = self._prefill(query[start : start + qlen], kv_cache, batch, req, ctx, window)
        return out

    def _gather(self, kv_cache: torch.Tensor, which: int, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        """Rows of ``block_tables`` ``[R, W]`` -> their first ``length`` tokens' K (``which`` 0) or V (1),
        ``[R, length, Hkv, D]`` (dequantized, in the compute dtype, from a quantized cache)."""
        cache = kv_cache[which]
        bs = self.spec.block_size
        pos = torch.arange(length, device=cache.device)
        col = (pos // bs).clamp_(max=block_tables.shape[1] - 1)
        blocks = block_tables[:, col].long()  # [R, length]
        rows = cache[blocks, (pos % bs).expand_as(blocks)]
        return kv_quant.dequantize(rows, self.spec, which, self.compute_dtype) if kv_quant.is_quantized(self.spec) else rows

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q`` ``[R, L, Hq, D]``, ``k``/``v`` ``[R, S, Hkv, D]``, ``mask`` bool ``[R, L, S]`` (True = attend)."""
        r, l, hq, d = q.shape
        hkv = k.shape[2]
        g = hq // hkv
        cd = self.compute_dtype
        # unwritten cache slots may hold NaN/inf: zero the values no query attends to (0 * NaN is NaN)
        v = v.masked_fill(~mask.any(dim=1)[:, :, None, None], 0)
        qg = q.to(cd).view(r, l, hkv, g, d)
        scores = torch.einsum("rlhgd,rshd->rhgls", qg, k.to(cd)) * self.spec.softmax_scale
        cap = self.spec.logits_soft_cap
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("rhgls,rshd->rlhgd", probs, v.to(cd))
        return o.reshape(r, l, hq, d).to(q.dtype)

    def _decode(self, q, kv_cache, batch: AttentionBatch, nd: int, length: int, window: int | None) -> torch.Tensor:
        tables = batch.block_tables[:nd]
        k = self._gather(kv_cache, 0, tables, length)
        v = self._gather(kv_cache, 1, tables, length)
        pos = torch.arange(length, device=q.device)[None, :]
        mask = pos < batch.seq_lens[:nd, None]  # [nd, S]
        if window is not None:  # the last `window` keys, from device lengths (no host sync: graph-safe)
            mask &= pos >= batch.seq_lens[:nd, None] - window
        return self._attend(q[:, None], k, v, mask[:, None, :])[:, 0]

    def _prefill(self, q, kv_cache, batch: AttentionBatch, req: int, ctx: int, window: int | None) -> torch.Tensor:
        qlen = q.shape[0]
        length = ctx + qlen
        tables = batch.block_tables[req : req + 1]
        k = self._gather(kv_cache, 0, tables, length)
        v = self._gather(kv_cache, 1, tables, length)
        qpos = ctx + torch.arange(qlen, device=q.device)
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos[:, None]  # causal, [L, S]
        if window is not None:
            mask &= kpos > qpos[:, None] - window
        return self._attend(q[None], k, v, mask[None])[0]
