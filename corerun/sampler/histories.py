"""Where the penalties get a step's token histories from, as flat positions ``row * V + token`` on the device.

``ListHistories`` flattens the step's lists (the runner hands them as views of its persistent
batch) and answers ``seen`` and ``counted``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from corerun.sampler._device import flat_positions, move


class Histories(Protocol):
    def seen(self, rows: Sequence[int], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token of the prompt or output of ``rows``, at least once: (``row * vocab_size + token``
        int64 ``[H]``, the row int64 ``[H]``) on ``device``; for the repetition penalty."""
        ...

    def counted(
        self, rows: Sequence[int], vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token of the output of ``rows``, at least once, with its count in that output:
        (positions, rows, counts), all int64 ``[H]`` on ``device``; for frequency and presence penalties."""
        ...


class ListHistories:
    """Histories read from the step's lists (``SamplingMetadata.prompt_token_ids`` / ``output_token_ids``).

    ``counted`` keeps every occurrence and counts them on the device: a sort and two ``searchsorted``.
    """

    def __init__(self, prompt_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[Sequence[int]]) -> None:
        self.prompts, self.outputs = prompt_token_ids, output_token_ids

    def seen(self, rows: Sequence[int], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        owners = [i for i in rows for _ in (0, 1)]
        seqs = [seq for i in rows for seq in (self.prompts[i], self.outputs[i])]
        index, row_ids = flat_positions(owners, seqs, vocab_size)
        return move(index, device), move(row_ids, device)

    def counted(
        self, rows: Sequence[int], vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index, row_ids = flat_positions(rows, [self.outputs[i] for i in rows], vocab_size)
        index, row_ids = move(index, device), move(row_ids, device)
        ordered = index.sort().values
        counts = torch.searchsorted(ordered, index, right=True) - torch.searchsorted(ordered, index)
        return index, row_ids, counts
