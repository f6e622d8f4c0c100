"""Verifying draft tokens through the ``Sampler`` protocol.

A request with drafts ``d_0 .. d_{k-1}`` gets ``k + 1`` logits rows in the step: row ``j`` is the
model's prediction after the request's tokens plus ``d_0 .. d_{j-1}``.  :func:`expand_metadata` gives
row ``j`` exactly the history it would have without speculation at that point (``output + d[:j]``),
so penalties, ``min_tokens`` and a seeded row's draw index (``len(output_token_ids)``) are those of
the non-speculative step.  The sampler draws a target ``t_j`` per row, independently
(``SamplerCapabilities.draft_verification``), and :func:`accept_drafts` keeps ``d_j`` while
``t_j == d_j``; the request gets ``t_0 .. t_a`` where ``a`` is the first mismatch (or ``k``).

Every emitted token is a draw from the distribution the non-speculative step would use at its
position, so the output has the same law: greedy output is the same token for token, and a seeded
request gives the same tokens.  For an n-gram draft (a point mass ``q = 1[d]``) this is the standard
rejection sampler: ``d_j`` is accepted with probability ``p_j(d_j) = min(1, p_j(d_j) / q(d_j))``, and
on rejection the token is ``t_j`` conditioned on ``t_j != d_j``, i.e. drawn from the residual
``max(p_j - q, 0)`` renormalised (``p_j`` with ``d_j`` removed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from corerun.protocols.sampler import SamplingMetadata


@dataclass
class SpecStats:
    """Acceptance counts since the engine started: draft tokens proposed and accepted, verified rows."""

    num_drafts: int = 0  # decode rows that carried drafts
    num_draft_tokens: int = 0  # draft tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified row: the accepted drafts plus the token sampled after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


def expand_metadata(seqs: Sequence[Any], drafts: Sequence[Sequence[int]], eos_token_ids: frozenset[int]) -> SamplingMetadata:
    """One row per verified position: ``len(drafts[i]) + 1`` rows for ``seqs[i]``, row ``j`` with history ``output + drafts[i][:j]``.

    No ``seq_ids``: a row's history may end in drafts that get rejected, which a sampler keying
    per-request state on ``seq_ids`` must not take in (their histories only grow).
    """
    params, prompts, outputs = [], [], []
    for seq, d in zip(seqs, drafts):
        out = seq.output_view()
        if not d:
            params.append(seq.params)
            prompts.append(seq.prompt_token_ids)
            outputs.append(out)
            continue
        base = list(out)
        for j in range(len(d) + 1):
            params.append(seq.params)
            prompts.append(seq.prompt_token_ids)
            outputs.append(base + list(d[:j]))
    return SamplingMetadata(params=params, prompt_token_ids=prompts, output_token_ids=outputs, eos_token_ids=eos_token_ids)


def accept_drafts(targets: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The tokens each request emits: ``targets`` holds ``len(drafts[i]) + 1`` sampled tokens per request, in order."""
    out: list[list[int]] = []
    o = 0
    for d in drafts:
        t = targets[o : o + len(d) + 1]
        a = 0
        while a < len(d) and t[a] == d[a]:
            a += 1
        out.append(list(t[: a + 1]))
        o += len(d) + 1
    if o != len(targets):
        raise ValueError(f"{len(targets)} sampled tokens for {o} verified positions")
    return out
