"""Repetition, frequency and presence penalties (vLLM's definitions), applied where the history is.

For row ``i`` with repetition penalty ``r``, frequency penalty ``f`` and presence penalty ``a``, and
``c[t]`` the count of token ``t`` in the row's OUTPUT tokens::

    t in prompt or output:  logit = logit / r if logit > 0 else logit * r
    then                    logit = logit - f * c[t] - a * (c[t] > 0)

Only entries ``(i, t)`` with ``t`` in row ``i``'s history change, so the work is proportional to the
history, not to ``B * V``: one gather and one scatter at the flattened positions ``i * V + t``.
Duplicate positions (a token seen twice) compute the same new value from the same old value, so the
scatter is well defined.  Counts come from a sort and two ``searchsorted`` calls, with no host sync.
"""

from __future__ import annotations

from typing import Sequence

import torch

from corerun_sampler_full._device import flat_positions, move


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
    if rep_rows:
        index, row_ids = flat_positions(
            [i for i in rep_rows for _ in (0, 1)],
            [seq for i in rep_rows for seq in (prompt_token_ids[i], output_token_ids[i])],
            vocab_size,
        )
        if index.numel():
            penalty = move(torch.tensor(repetition, dtype=torch.float32)[row_ids], device)
            index = move(index, device)
            old = flat[index]
            flat.index_put_((index,), torch.where(old > 0, old / penalty, old * penalty))

    out_rows = [i for i in range(len(frequency)) if frequency[i] != 0.0 or presence[i] != 0.0]
    if out_rows:
        index, row_ids = flat_positions(out_rows, [output_token_ids[i] for i in out_rows], vocab_size)
        if index.numel():
            freq = move(torch.tensor(frequency, dtype=torch.float32)[row_ids], device)
            pres = move(torch.tensor(presence, dtype=torch.float32)[row_ids], device)
            index = move(index, device)
            ordered = index.sort().values
            counts = torch.searchsorted(ordered, index, right=True) - torch.searchsorted(ordered, index)
            flat.index_put_((index,), flat[index] - freq * counts.to(torch.float32) - pres)
