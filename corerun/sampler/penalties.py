"""Repetition, frequency and presence penalties (vLLM's definitions), applied where the history is.

For row ``i`` with repetition penalty ``r``, frequency penalty ``f`` and presence penalty ``a``, and
``c[t]`` the count of token ``t`` in the row's OUTPUT tokens::

    t in prompt or output:  logit = logit / r if logit > 0 else logit * r
    then                    logit = logit - f * c[t] - a * (c[t] > 0)

Only entries ``(i, t)`` with ``t`` in row ``i``'s history change, so the work is proportional to the
history, not to ``B * V``: one gather and one scatter at the flattened positions ``i * V + t``.
Duplicate positions (a token seen twice) compute the same new value from the same old value, so the
scatter is well defined.  Nothing waits on the device.

The positions (and output counts) come from the step's lists (``ListHistories``: every occurrence,
counted by a sort and two ``searchsorted`` calls); the runner hands the lists as views of its
persistent batch, so nothing is copied before they are read.
"""

from __future__ import annotations

from typing import Sequence

import torch

from corerun.sampler.common import to_device
from corerun.sampler.histories import Histories, ListHistories


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """Apply the penalties in place to ``logits`` float32 ``[B, V]`` (contiguous); per-row lists of length ``B``."""
    vocab_size = logits.shape[1]
    flat = logits.view(-1)
    device = logits.device
    rep_rows = [i for i, r in enumerate(repetition) if r != 1.0]
    out_rows = [i for i in range(len(frequency)) if frequency[i] != 0.0 or presence[i] != 0.0]

    histories: Histories = ListHistories(prompt_token_ids, output_token_ids)

    if rep_rows:
        index, row_ids = histories.seen(rep_rows, vocab_size, device)
        if index.numel():
            penalty = to_device(repetition, torch.float32, device).index_select(0, row_ids)
            old = flat.index_select(0, index)
            flat.index_copy_(0, index, torch.where(old > 0, old / penalty, old * penalty))

    if out_rows:
        index, row_ids, counts = histories.counted(out_rows, vocab_size, device)
        if index.numel():
            freq = to_device(frequency, torch.float32, device).index_select(0, row_ids)
            pres = to_device(presence, torch.float32, device).index_select(0, row_ids)
            flat.index_copy_(0, index, flat.index_select(0, index) - freq * counts.to(torch.float32) - pres)
