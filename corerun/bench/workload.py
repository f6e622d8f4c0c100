"""The offline throughput workloads of ``corerun bench``.

``random`` (the default; nano-vllm's ``bench.py``, vLLM's random dataset): ``num_seqs`` requests;
request ``i`` has a prompt of ``input_len_i`` random token ids and asks for exactly ``output_len_i``
tokens (``ignore_eos``), both lengths drawn uniformly (inclusive) from their ranges.

``repetitive`` (speculative decoding's case): each prompt is a numbered list of 40 short lines and
asks the model to copy it, the first line already given (:func:`repetitive_prompt`), so the output
repeats the prompt's own context; the text is tokenized by the model's tokenizer.

Everything comes from one ``random.Random(seed)``, so a seed names the workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

TOKEN_ID_LIMIT = 10_000  # nano-vllm draws prompt tokens from [0, 10000]: ordinary ids, no special tokens


@dataclass(frozen=True, slots=True)
class LengthRange:
    """An inclusive range ``[lo, hi]`` of token counts, ``1 <= lo <= hi``."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if isinstance(self.lo, bool) or isinstance(self.hi, bool) or not isinstance(self.lo, int) or not isinstance(self.hi, int):
            raise ValueError(f"a length range needs two integers, got {self.lo!r}:{self.hi!r}")
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"a length range needs 1 <= MIN <= MAX, got {self.lo}:{self.hi}")

    def __str__(self) -> str:
        return f"{self.lo}:{self.hi}"


def parse_range(text: str | int | tuple[int, int] | LengthRange) -> LengthRange:
    """``"32:128"``, ``"32 128"``, ``"64"`` (a fixed length), ``64`` or ``(32, 128)`` -> :class:`LengthRange`."""
    if isinstance(text, LengthRange):
        return text
    if isinstance(text, int) and not isinstance(text, bool):
        return LengthRange(text, text)
    if isinstance(text, tuple):
        return LengthRange(*text)
    parts = str(text).replace(":", " ").replace(",", " ").split()
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2:
        raise ValueError(f"a length range is MIN:MAX (e.g. 32:128) or one length (e.g. 64), got {text!r}")
    return LengthRange(*values)


@dataclass(frozen=True)
class Workload:
    """The requests of one benchmark run: ``prompts[i]`` (token ids) asks for ``output_lens[i]`` tokens."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int
    input_len: LengthRange
    output_len: LengthRange
    kind: str = "random"  # or "repetitive" (make_repetitive_workload)

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "num_seqs": self.num_seqs,
            "input_len": [self.input_len.lo, self.input_len.hi],
            "output_len": [self.output_len.lo, self.output_len.hi],
            "seed": self.seed,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
        }


def make_workload(
    num_seqs: int,
    input_len: LengthRange | str | int,
    output_len: LengthRange | str | int,
    seed: int = 0,
    vocab_size: int = TOKEN_ID_LIMIT,
) -> Workload:
    """Draw the workload for ``seed``: token ids uniform in ``[0, min(vocab_size, 10000))``.

    Draw order per request: input length, its token ids, output length (so a request's prompt does
    not change when only the output range does, and vice versa for the other requests' lengths).
    """
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be an integer >= 1, got {num_seqs!r}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    inp, out = parse_range(input_len), parse_range(output_len)
    limit = min(vocab_size, TOKEN_ID_LIMIT)
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_seqs):
        n = rng.randint(inp.lo, inp.hi)
        prompts.append([rng.randrange(limit) for _ in range(n)])
        output_lens.append(rng.randint(out.lo, out.hi))
    return Workload(prompts, output_lens, seed, inp, out)


WORKLOADS = ("random", "repetitive")
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def repetitive_prompt(rng: random.Random, num_lines: int = 40) -> str:
    """A list of ``num_lines`` lines ``"i. word word NN"`` and the request to copy it, its first line
    already written: a greedy model that copies repeats the prompt's own n-grams."""
    items = [f"{i + 1}. {rng.choice(_WORDS)} {rng.choice(_WORDS)} {rng.randint(10, 99)}" for i in range(num_lines)]
    text = "\n".join(items)
    return f"Here is a list:\n{text}\n\nCopy the list above exactly, line by line:\n{items[0]}\n"


def make_repetitive_workload(
    num_seqs: int, output_len: LengthRange | str | int, seed: int, encode: Callable[[str], list[int]],
) -> Workload:
    """``num_seqs`` copy-the-list requests (:func:`repetitive_prompt`) tokenized by ``encode``.

    Draw order per request: its prompt, then its output length; request 0 of seed 0 is the prompt of
    ``repetitive_prompt(random.Random(0))``, the prompt of the earlier runs in benchmarks/RESULTS.md.
    """
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be an integer >= 1, got {num_seqs!r}")
    out = parse_range(output_len)
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_seqs):
        prompts.append(list(encode(repetitive_prompt(rng))))
        output_lens.append(rng.randint(out.lo, out.hi))
    lens = [len(p) for p in prompts]
    return Workload(prompts, output_lens, seed, LengthRange(min(lens), max(lens)), out, kind="repetitive")


def warmup_prompt(workload: Workload, vocab_size: int = TOKEN_ID_LIMIT) -> list[int]:
    """A prompt for the warm-up run, as long as the shortest workload prompt and drawn apart from it
    (a different stream), so the warm-up leaves no cached prefix the measured requests could reuse."""
    rng = random.Random(f"warmup-{workload.seed}")
    limit = min(vocab_size, TOKEN_ID_LIMIT)
    return [rng.randrange(limit) for _ in range(workload.input_len.lo)]
