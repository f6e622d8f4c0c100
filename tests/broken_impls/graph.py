"""A graph runner that pads decode batches the way a CUDA-graph runner does, correctly and not."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import GraphLimits, GraphStats, ModelInputs


class PaddingRunner:
    """Correct: pads every pure-decode batch to ``max_batch_size`` with padding rows (length 1,
    context 0, slot ``PAD_SLOT``), runs eagerly, and returns the real rows."""

    name: ClassVar[str] = "padding"
    PAD_SLOT: ClassVar[int] = -1

    def __init__(self, model: Any, attention: Any, limits: GraphLimits) -> None:
        self.model, self.attention, self.limits = model, attention, limits
        self.stats = GraphStats()

    def capture(self) -> None:
        pass

    @torch.no_grad()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        b = inputs.batch
        pad = self.limits.max_batch_size - b.num_reqs
        if not b.is_pure_decode or pad <= 0:
            return self.model(inputs.input_ids, inputs.positions, self.attention.plan(b))
        dev = b.seq_lens.device

        def cat(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype, device=dev)])

        qsl = torch.arange(b.num_reqs + pad + 1, dtype=torch.int32)
        seq = cat(b.seq_lens, 1)
        padded = AttentionBatch(
            query_start_loc=qsl.to(dev), seq_lens=seq, context_lens=cat(b.context_lens, 0),
            block_tables=cat(b.block_tables, 0), slot_mapping=cat(b.slot_mapping, self.PAD_SLOT),
            num_reqs=b.num_reqs + pad, num_tokens=b.num_tokens + pad, max_query_len=1, max_seq_len=b.max_seq_len,
            num_decodes=b.num_reqs + pad, query_start_loc_cpu=qsl, seq_lens_cpu=seq.cpu(),
        )
        hidden = self.model(cat(inputs.input_ids, 0), cat(inputs.positions, 0), self.attention.plan(padded))
        return hidden[: b.num_tokens]


class WritesPaddingKV(PaddingRunner):
    """Broken: its padding rows carry slot 0 instead of -1, so they overwrite a real cache slot."""

    name = "writes-padding-kv"
    PAD_SLOT = 0
