"""The changing batch of the sampler suite's ``seq_id_history`` check: steps of requests with ``seq_ids``.

Eight steps over eight requests, each with its own ``seq_id``: requests join late, leave, come back
with outputs that grew meanwhile or (as a request the scheduler skipped) did not, gain one or several
tokens a step, finish (named once in ``SamplingMetadata.finished_seq_ids``, protocol version 2), and
the rows are shuffled every step.  The histories are the suite's own: a sampler must read them from
the metadata, not assume its draws were appended.

Each row's logits are built from its history so that the greedy choice depends on the newest output
token ``t``: ``t`` gets the top raw logit, and a decoy token (never in any history) sits halfway
between the values the penalties give ``t`` with the current history and with the history the
request had at its previous step.  A sampler that penalises from a stale history then takes ``t``
where the reference takes the decoy.  ``min_tokens`` rows put a stop token on top, masked until the
output reaches ``min_tokens`` partway through the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from corerun.conformance.reference.sampling import processed_logits
from corerun.sampling_params import SamplingParams

VOCAB = 64
PROMPT_TOKENS = 20  # prompts draw from [0, 20); outputs from [20, 56)
OUTPUT_TOKENS = range(20, 56)
DECOYS = (56, 57, 58, 59, 60, 61)  # never in a history
EOS = 62
STOP = 63
STEPS = 8
PENALTIES = {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.9}

# (name, parameters, the fields they need declared); ``min_tokens`` is set per request
VARIANTS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("greedy", {"temperature": 0.0}, {"temperature"}),
    ("repetition", {"temperature": 0.0, "repetition_penalty": 1.5}, {"temperature", "repetition_penalty"}),
    ("frequency", {"temperature": 0.0, "frequency_penalty": 0.7}, {"temperature", "frequency_penalty"}),
    ("presence", {"temperature": 0.0, "presence_penalty": 0.9}, {"temperature", "presence_penalty"}),
    ("penalties", {"temperature": 0.0, **PENALTIES}, {"temperature", *PENALTIES}),
    ("min_tokens", {"temperature": 0.0, "stop_token_ids": (STOP,), "max_tokens": 64}, {"temperature", "min_tokens"}),
    ("seeded", {}, {"seed"}),
]

# the steps each request is in the batch, its output length when it first appears, and the tokens it
# gains before a step where that is not one: request 1 comes back with more, request 2 skipped two
# steps and comes back with the same history, 6 grows by three; request 4 finishes after step 4
PRESENT = [
    range(0, 8), (0, 1, 4, 5, 6, 7), (0, 1, 2, 3, 6, 7), range(1, 8), (0, 1, 2, 3, 4), range(3, 8), range(0, 8), range(2, 8),
]
FIRST_OUTPUT = [0, 2, 3, 1, 4, 2, 1, 3]
GAINS = {(1, 4): 3, (2, 6): 0, (6, 2): 3, (6, 5): 3}
FINISHED_AFTER = {4: 4}  # request -> its last step (then named in the next step's finished_seq_ids)


@dataclass
class Row:
    seq_id: int
    variant: str
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    previous: list[int]  # the output at the request's previous step (its output when it first appears)


@dataclass
class HistoryStep:
    rows: list[Row]
    logits: torch.Tensor  # float32 [len(rows), VOCAB]
    finished: frozenset[int]  # seq_ids of requests finished since the previous step


def variants(declared: frozenset[str]) -> list[tuple[str, dict[str, Any]]]:
    """The variants a sampler declaring ``declared`` can run; ``seeded`` takes whatever penalties it declares."""
    out = []
    for name, params, needs in VARIANTS:
        if needs <= declared:
            if name == "seeded":
                params = {"temperature": 0.6} if "temperature" in declared else {}
                params.update({k: v for k, v in PENALTIES.items() if k in declared})
            out.append((name, params))
    return out


def history_steps(declared: frozenset[str], seed: int) -> list[HistoryStep]:
    """The run's steps for a sampler declaring ``declared`` (needs ``temperature``), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    kinds = variants(declared)
    prompts = [torch.randint(PROMPT_TOKENS, (3 + r,), generator=gen).tolist() for r in range(len(PRESENT))]
    outputs: list[list[int]] = [[] for _ in PRESENT]
    steps = []
    for k in range(STEPS):
        rows = []
        for r, present in enumerate(PRESENT):
            if k not in present:
                continue
            first, previous = k == present[0], list(outputs[r])
            for _ in range(FIRST_OUTPUT[r] if first else GAINS.get((r, k), 1)):
                outputs[r].append(_next_token(outputs[r], gen))
            if first:
                previous = list(outputs[r])
            name, params = kinds[r % len(kinds)]
            if name == "min_tokens":
                params = {**params, "min_tokens": FIRST_OUTPUT[r] + 3}
            elif name == "seeded":
                params = {**params, "seed": 1000 + r}
            rows.append(Row(7919 * (r + 1), name, SamplingParams(**params), list(prompts[r]), list(outputs[r]), previous))
        order = torch.randperm(len(rows), generator=gen).tolist()
        rows = [rows[j] for j in order]
        logits = torch.stack([_row_logits(row, gen) for row in rows]).to(torch.float32)
        finished = frozenset(7919 * (r + 1) for r, last in FINISHED_AFTER.items() if last == k - 1)
        steps.append(HistoryStep(rows, logits, finished))
    return steps


def _next_token(output: list[int], gen: torch.Generator) -> int:
    """Every third token (about) repeats one of the output's tokens; the others are new to it."""
    if output and int(torch.randint(3, (1,), generator=gen)) == 0:
        return output[int(torch.randint(len(output), (1,), generator=gen))]
    fresh = [t for t in OUTPUT_TOKENS if t not in output]
    return fresh[int(torch.randint(len(fresh), (1,), generator=gen))]


def _row_logits(row: Row, gen: torch.Generator) -> torch.Tensor:
    """float64 ``[VOCAB]``: a background far below, and the top two set as the module docstring says."""
    raw = torch.linspace(-12, -6, VOCAB, dtype=torch.float64)[torch.randperm(VOCAB, generator=gen)]
    raw += torch.rand(VOCAB, generator=gen, dtype=torch.float64) * 0.01
    decoy = DECOYS[row.seq_id % len(DECOYS)]
    if row.variant == "min_tokens":
        raw[STOP], raw[decoy] = 3.0, 2.0
    elif not row.output:
        raw[decoy] = 2.0
    else:
        t = row.output[-1]
        raw[t] = 3.0
        now = processed_logits(raw, row.params, row.prompt, row.output, {EOS})[t].item()
        before = processed_logits(raw, row.params, row.prompt, row.previous, {EOS})[t].item()
        raw[decoy] = (now + before) / 2 if before - now >= 0.2 else now - 1.0
    return raw
