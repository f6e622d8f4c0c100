"""min-p, top-k and top-p (vLLM's order and definitions) as one cutoff per row.

After temperature, row ``i`` keeps the tokens that survive, in order:

1. min-p: ``prob >= min_p * max_prob``, i.e. ``logit >= max_logit + log(min_p)``;
2. top-k: the ``k`` largest logits (``k = 0``, or ``k >= V``: off);
3. top-p: the most likely tokens, in decreasing order, while the probability mass of those before
   them (renormalised over the survivors of 1 and 2) is below ``top_p`` (at least one token).

Each survivor set is "every logit >= some value", so the row reduces to one ``cutoff`` and one
``masked_fill`` over the batch does all three.  Ties at the cutoff all survive.

Only what is needed is sorted: rows with top-k take ``torch.topk`` with the largest ``k`` of the
batch (already sorted, and top-p needs no more since its survivors lie inside the top-k); only rows
with top-p and no top-k sort their whole row; min-p alone needs a row max.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from corerun.sampler.common import to_device


def apply_truncation(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> None:
    """Set the tokens outside min-p / top-k / top-p of each row to -inf, in place (float32 ``[B, V]``).

    Per-row lists of length ``B``; ``top_k`` 0, ``top_p`` 1.0 and ``min_p`` 0.0 turn a rule off (a row
    with all three off is left as it is).
    """
    batch, vocab_size = logits.shape
    device = logits.device
    top_k = [k if 0 < k < vocab_size else 0 for k in top_k]
    k_rows = [i for i in range(batch) if top_k[i]]
    p_rows = [i for i in range(batch) if not top_k[i] and top_p[i] < 1.0]
    if not k_rows and not p_rows and not any(m > 0.0 for m in min_p):
        return
    log_min_p = to_device([math.log(m) if m > 0.0 else -math.inf for m in min_p], torch.float32, device)
    if any(m > 0.0 for m in min_p):
        cutoff = logits.amax(dim=-1) + log_min_p  # min-p alone; -inf where off
    else:
        cutoff = torch.full((batch,), float("-inf"), device=device)
    for rows, width in ((k_rows, max((top_k[i] for i in k_rows), default=0)), (p_rows, vocab_size)):
        if not rows:
            continue
        index = to_device(rows, torch.int64, device)
        sub = logits if len(rows) == batch else logits[index]  # (advanced indexing: far faster than index_select on CPU)
        if width < vocab_size:
            ordered = sub.topk(width, dim=-1).values
        else:
            ordered = sub.sort(dim=-1, descending=True).values
        row_cut = sorted_cutoff(
            ordered,
            to_device([top_k[i] or width for i in rows], torch.int64, device),
            to_device([top_p[i] for i in rows], torch.float32, device),
            log_min_p.index_select(0, index),
        )
        cutoff.index_copy_(0, index, row_cut)
    logits.masked_fill_(logits < cutoff[:, None], float("-inf"))


def sorted_cutoff(
    ordered: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor
) -> torch.Tensor:
    """The smallest surviving logit of each row.

    ``ordered`` float32 ``[R, W]``: each row's ``W`` largest logits, in decreasing order; ``top_k``
    int64 ``[R]`` (``<= W``), ``top_p`` float32 ``[R]`` (1.0: off), ``log_min_p`` float32 ``[R]`` (-inf: off).
    Returns float32 ``[R]``.
    """
    width = ordered.shape[1]
    alive = torch.arange(width, device=ordered.device)[None, :] < top_k[:, None]
    alive &= ordered >= ordered[:, :1] + log_min_p[:, None]
    probs = ordered.masked_fill(~alive, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = alive & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    count = keep.sum(dim=-1).clamp_min(1)
    return ordered.gather(1, (count - 1)[:, None]).squeeze(1)
