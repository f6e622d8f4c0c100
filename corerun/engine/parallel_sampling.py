"""``n > 1``: several samples of one prompt, forked after its prefill so they share its KV blocks.

A request with ``SamplingParams(n=k)`` is queued as one sequence, its head, with its ``k - 1`` forks
(``Scheduler.add(head, forks)``).  Once the head's prompt is computed (its full blocks hashed into the
prefix cache), the scheduler puts the forks at the front of the waiting queue; with prefix caching on they find the prompt's blocks already
computed and only their own tokens cost anything.  Each child is a sequence of its own for the
scheduler and the sampler (its own ``seq_id``; ``seed + i`` when the request has a seed, as vLLM
does), and the request finishes when all of them have.

A front sees a :class:`SequenceGroup` where it would see a sequence: the same ``request_id``, and
``is_finished`` once every sample is done; ``LLMEngine.output`` turns it into one ``RequestOutput``
with one ``CompletionOutput`` per sample (``index`` 0 .. k-1).
"""

from __future__ import annotations

from typing import Callable

from corerun.core.sequence import Sequence
from corerun.outputs import RequestOutput


class SequenceGroup:
    """The ``n`` sequences of one request: ``seqs[0]`` is the head, queued first."""

    __slots__ = ("request_id", "seqs")

    def __init__(self, head: Sequence, children: list[Sequence]) -> None:
        self.request_id = head.request_id
        self.seqs = [head, *children]

    @property
    def head(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def prompt(self) -> str | None:
        return self.head.prompt

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.head.prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.seqs)

    @property
    def output_token_ids(self) -> list[int]:
        """The head's generated tokens (what a front reporting one sample reads)."""
        return self.head.output_token_ids


def fork(head: Sequence, next_seq_id: Callable[[], int]) -> SequenceGroup:
    """The group of ``head.params.n`` samples of ``head``'s prompt (children built, not queued)."""
    p = head.params
    children = []
    for i in range(1, p.n):
        update: dict = {"prompt_logprobs": None}  # computed once, by the head
        if p.seed is not None:
            update["seed"] = (p.seed + i) % 2**64
        children.append(Sequence(
            seq_id=next_seq_id(), request_id=head.request_id, prompt_token_ids=head.prompt_token_ids,
            params=p.model_copy(update=update), prompt=head.prompt, arrival_time=head.arrival_time, lora=head.lora,
        ))
    return SequenceGroup(head, children)


def as_requests(touched: list[Sequence], group_of: dict[int, SequenceGroup]) -> list[Sequence | SequenceGroup]:
    """A step's touched sequences as the requests a front tracks: the samples of an ``n > 1`` request
    become their group, once."""
    out: list[Sequence | SequenceGroup] = []
    seen: set[int] = set()
    for seq in touched:
        group = group_of.get(seq.seq_id)
        if group is None:
            out.append(seq)
        elif id(group) not in seen:
            seen.add(id(group))
            out.append(group)
    return out


def group_output(group: SequenceGroup, one: Callable[[Sequence], RequestOutput]) -> RequestOutput:
    """One ``RequestOutput`` for the group: one ``CompletionOutput`` per sample, in sample order."""
    outs = [one(s) for s in group.seqs]
    head = outs[0]
    completions = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        c.index = i
        completions.append(c)
    metrics = dict(head.metrics)
    firsts = [o.metrics["first_token_time"] for o in outs if "first_token_time" in o.metrics]
    if firsts:
        metrics["first_token_time"] = min(firsts)
    finished = group.is_finished
    if finished:
        metrics["finish_time"] = max(o.metrics.get("finish_time", 0.0) for o in outs)
    else:
        metrics.pop("finish_time", None)
    return RequestOutput(
        request_id=group.request_id, prompt=head.prompt, prompt_token_ids=head.prompt_token_ids, outputs=completions,
        finished=finished, prompt_logprobs=head.prompt_logprobs, metrics=metrics,
    )
