"""Which part of each weight a tensor-parallel rank holds: pure arithmetic, and the checks behind it.

Attention: rank ``r`` of ``n`` holds query heads ``[r * Hq/n, (r+1) * Hq/n)``.  When ``Hkv >= n`` the
KV heads are split the same way; when ``Hkv < n`` (``n`` a multiple of ``Hkv``) each KV head is
replicated on ``n / Hkv`` consecutive ranks, and every rank holds the one KV head its query heads use
(query head ``h`` uses KV head ``h // (Hq / Hkv)``).
MLP: the intermediate features are split evenly.  Vocabulary: ``ceil(V / n)`` rows per rank, the last
rank's range padded with zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from corerun.errors import ConfigError


class ModelShape(Protocol):
    """The sizes of a model that sharding reads (``corerun.models.config.ModelConfig`` has them); this
    layer sits below the models and names none of their classes."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank holds (global head indices)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # key/value heads on this rank
    q_start: int  # first query head
    kv_start: int  # first key/value head


@dataclass(frozen=True, slots=True)
class VocabShard:
    """Vocabulary rows ``[start, end)`` of ``vocab_size``, held in a table of ``rows_per_rank`` rows (zero-padded)."""

    vocab_size: int
    start: int
    end: int
    rows_per_rank: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """Rank ``rank``'s heads; raises ConfigError when ``world_size`` does not fit the head counts."""
    problems = head_problems(num_heads, num_kv_heads, world_size)
    if problems:
        raise ConfigError(f"tensor_parallel_size {world_size}: " + "; ".join(problems))
    q_per_rank = num_heads // world_size
    if num_kv_heads >= world_size:
        kv_per_rank = num_kv_heads // world_size
        return HeadShard(q_per_rank, kv_per_rank, rank * q_per_rank, rank * kv_per_rank)
    return HeadShard(q_per_rank, 1, rank * q_per_rank, rank // (world_size // num_kv_heads))


def head_problems(num_heads: int, num_kv_heads: int, world_size: int) -> list[str]:
    """Why ``world_size`` ranks cannot split these heads (empty when they can)."""
    problems = []
    if num_heads % world_size:
        problems.append(f"it must divide num_attention_heads {num_heads}")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        problems.append(
            f"it must divide num_key_value_heads {num_kv_heads} (heads split) or be a multiple of it (heads replicated)"
        )
    return problems


def shard_range(size: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s even slice of ``size`` features; ``what`` names them in errors."""
    if size % world_size:
        raise ConfigError(f"tensor_parallel_size {world_size} must divide {what} {size}")
    length = size // world_size
    return rank * length, length


def shard_vocab(vocab_size: int, rank: int, world_size: int) -> VocabShard:
    """Rank ``rank``'s vocabulary rows: ``ceil(vocab_size / world_size)`` per rank, the last range shorter."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return VocabShard(vocab_size, start, min(start + per_rank, vocab_size), per_rank)


def model_problems(config: ModelShape, world_size: int) -> list[str]:
    """Every reason ``world_size`` ranks cannot split this model (empty when they can)."""
    problems = head_problems(config.num_heads, config.num_kv_heads, world_size)
    if config.intermediate_size % world_size:
        problems.append(f"it must divide intermediate_size {config.intermediate_size}")
    return problems


def valid_sizes(config: ModelShape) -> list[int]:
    """The tensor-parallel sizes this model can be split into."""
    return [n for n in range(1, config.num_heads + 1) if not model_problems(config, n)]


def check_model(config: ModelShape, world_size: int) -> None:
    """Raise ConfigError naming every problem and the sizes that would work."""
    problems = model_problems(config, world_size)
    if problems:
        raise ConfigError(
            f"tensor_parallel_size {world_size} cannot split this model: " + "; ".join(problems)
            + f". Sizes that work for it: {', '.join(map(str, valid_sizes(config)))}"
        )
