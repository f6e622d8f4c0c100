"""A small correct logits processor and two broken ones (one override each).

``TrieChoice`` serves ``structured_outputs.choice`` with each choice read as space-separated token ids
("12 7 30" is tokens 12, 7, 30): a row keeps only the tokens that continue a choice from what the
request has made so far (token 0 ends it once a choice is complete).
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from corerun.plugin.capabilities import LogitsProcessorCapabilities
from corerun.sampling_params import SamplingParams

END = 0


class TrieChoice:
    name: ClassVar[str] = "trie_choice"
    capabilities: ClassVar[LogitsProcessorCapabilities] = LogitsProcessorCapabilities(params=frozenset({"structured_outputs"}))

    def __init__(self, vocab_size: int, device: torch.device, *, tokenizer: Any = None, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.vocab_size = vocab_size
        self.state: dict[Any, list[int]] = {}  # key -> tokens made
        self.choices: dict[Any, list[list[int]]] = {}

    @staticmethod
    def parse(params: SamplingParams) -> list[list[int]]:
        return [[int(t) for t in c.split()] for c in params.structured_outputs.choice]

    def prepare(self, params: SamplingParams) -> None:
        if params.structured_outputs is None or params.structured_outputs.choice is None:
            raise ValueError("trie_choice serves structured_outputs.choice only")
        self.parse(params)

    def state_key(self, key: int, params: SamplingParams) -> Any:
        return key

    def add_request(self, key: int, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        k = self.state_key(key, params)
        self.choices[k] = self.parse(params)
        self.state.setdefault(k, []).extend(int(t) for t in output_token_ids)

    def allowed(self, key: Any) -> list[int]:
        made = self.state[key]
        nxt = {c[len(made)] for c in self.choices[key] if c[: len(made)] == made and len(c) > len(made)}
        if any(c == made for c in self.choices[key]):
            nxt.add(END)
        return sorted(nxt)

    def mask_row(self, logits: torch.Tensor, row: int, key: Any) -> None:
        keep = torch.full((logits.shape[1],), float("-inf"), dtype=logits.dtype)
        keep[self.allowed(key)] = 0.0
        logits[row] += keep.to(logits.device)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], keys: Sequence[int]) -> None:
        for row, key in zip(rows, keys):
            self.mask_row(logits, row, key)

    def accept(self, keys: Sequence[int], tokens: Sequence[int]) -> list[str | None]:
        out: list[str | None] = []
        for key, token in zip(keys, tokens):
            if token == END:
                out.append("stop")
                continue
            self.state[key].append(int(token))
            out.append(None)
        return out

    def remove_request(self, key: int) -> None:
        self.state.pop(key, None)
        self.choices.pop(key, None)

    @property
    def num_requests(self) -> int:
        return len(self.state)


class LeaksBetweenRequests(TrieChoice):
    """Keys its state by the request's choices (a cache of the compiled grammar, with its position in it):
    two requests with the same parameters share one position."""

    name = "leaks_between_requests"

    def state_key(self, key: int, params: SamplingParams) -> Any:
        shared = tuple(params.structured_outputs.choice)
        self.__dict__.setdefault("keys", {})[key] = shared
        return shared

    def apply(self, logits: torch.Tensor, rows: Sequence[int], keys: Sequence[int]) -> None:
        super().apply(logits, rows, [self.keys[k] for k in keys])

    def accept(self, keys: Sequence[int], tokens: Sequence[int]) -> list[str | None]:
        return super().accept([self.keys[k] for k in keys], tokens)

    def remove_request(self, key: int) -> None:
        pass  # the shared state stays for the next request with the same choices


class MasksWrongRows(TrieChoice):
    """Masks row ``i`` of the batch for the ``i``-th request, not row ``rows[i]``."""

    name = "masks_wrong_rows"

    def apply(self, logits: torch.Tensor, rows: Sequence[int], keys: Sequence[int]) -> None:
        for i, key in enumerate(keys):
            self.mask_row(logits, i, key)
