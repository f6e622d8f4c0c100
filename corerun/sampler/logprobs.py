"""Logprobs in vLLM's ``LogprobsTensors`` layout: the chosen token, its rank, and the top-k."""

from __future__ import annotations

import torch

from corerun.protocols import LogprobsTensors


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """``logprobs`` float32 ``[N, V]`` (log_softmax rows), ``token_ids`` int64 ``[N]`` -> ``LogprobsTensors``.

    Column 0 is ``token_ids`` and its logprob, columns ``1..num_logprobs`` the row's most likely tokens
    in decreasing order; ``ranks[n]`` is the number of tokens at least as likely as ``token_ids[n]``
    (1 = the most likely; ties rank it last among them, as vLLM).
    """
    token_ids = token_ids.to(torch.int64)[:, None]
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat((token_ids, top.indices), dim=1),
        logprobs=torch.cat((chosen, top.values), dim=1),
        ranks=ranks,
    )
