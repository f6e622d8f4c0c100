"""Attention cases from declared capabilities: dtype x head size x block size x GQA ratio.

By default the cross product is sampled so that every declared dtype, every head-size class
(<= 64, not a power of two, 128, > 128), two block sizes and with/without GQA each appear, with
block size x GQA crossed in full; ``full`` gives the whole product.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Any

from corerun.conformance.tolerances import SHORT_DTYPE

DTYPE_ORDER = ("bfloat16", "float16", "float32", "float64")
CANDIDATE_HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 256)  # when a backend takes "any head size"
CANDIDATE_BLOCK_SIZES = (8, 16, 32, 64)  # when a backend takes "any block size"
DEFAULT_BLOCK_SIZES = (16, 32)
# GQA ratio -> (num_heads, num_kv_heads); ratio 8 with one KV head is MQA.
HEADS = {1: (4, 4), 2: (4, 2), 4: (8, 2), 8: (8, 1)}


@dataclass(frozen=True)
class AttentionConfig:
    dtype: str
    head_size: int
    block_size: int
    num_heads: int
    num_kv_heads: int

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def id(self) -> str:
        heads = f"mqa{self.gqa_ratio}" if self.num_kv_heads == 1 and self.num_heads > 1 else f"gqa{self.gqa_ratio}"
        return f"{SHORT_DTYPE.get(self.dtype, self.dtype)}-hd{self.head_size}-bs{self.block_size}-{heads}"

    def spec(self, device: str) -> Any:
        import torch

        from corerun.protocols.attention import DTYPE_NAMES, AttentionSpec

        return AttentionSpec(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            dtype=DTYPE_NAMES[self.dtype], block_size=self.block_size, device=torch.device(device),
        )


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def dtype_choices(caps: Any) -> list[str]:
    return [d for d in DTYPE_ORDER if d in caps.dtypes]


def head_size_choices(caps: Any, full: bool) -> list[int]:
    if caps.head_sizes is not None:
        allowed = sorted(h for h in caps.head_sizes if caps.max_head_size is None or h <= caps.max_head_size)
    else:
        allowed = [h for h in CANDIDATE_HEAD_SIZES if caps.max_head_size is None or h <= caps.max_head_size]
        if not allowed and caps.max_head_size:
            allowed = [caps.max_head_size]
    if full or len(allowed) <= 1:
        return allowed
    picks: list[int] = []
    if 128 in allowed:
        picks.append(128)
    small = [h for h in allowed if h <= 64]
    picks.append(max(small) if small else min(allowed))
    odd = [h for h in allowed if not _is_pow2(h)]
    if odd:
        picks.append(min(odd))
    if max(allowed) > 128:
        picks.append(max(allowed))
    return list(dict.fromkeys(picks))


def block_size_choices(caps: Any, full: bool) -> list[int]:
    if caps.block_sizes is not None:
        allowed = sorted(caps.block_sizes)
        return allowed if full else allowed[:2]
    return list(CANDIDATE_BLOCK_SIZES if full else DEFAULT_BLOCK_SIZES)


def gqa_choices(caps: Any, full: bool) -> list[int]:
    if not caps.gqa:
        return [1]
    return [1, 2, 4, 8] if full else [4, 1]


def attention_configs(caps: Any, full: bool) -> list[AttentionConfig]:
    """The configurations every forward check runs on (empty when nothing is declared)."""
    dtypes, heads = dtype_choices(caps), head_size_choices(caps, full)
    blocks, ratios = block_size_choices(caps, full), gqa_choices(caps, full)
    if not (dtypes and heads and blocks and ratios):
        return []
    if full:
        rows = list(product(dtypes, heads, blocks, ratios))
    else:
        pairs = list(product(blocks, ratios))
        n = max(len(dtypes), len(heads), len(pairs))
        rows = [(dtypes[i % len(dtypes)], heads[i % len(heads)], *pairs[i % len(pairs)]) for i in range(n)]
    configs = [AttentionConfig(d, h, b, *HEADS[r]) for d, h, b, r in rows]
    return list(dict.fromkeys(configs))


def unsupported_configs(caps: Any) -> list[tuple[str, AttentionConfig, str]]:
    """``(case id, config, what is undeclared)`` for each dimension with a value outside the declared set."""
    base_list = attention_configs(caps, full=False)
    if not base_list:
        return []
    base = base_list[0]
    out: list[tuple[str, AttentionConfig, str]] = []
    missing = [d for d in ("float16", "bfloat16", "float32", "float64") if d not in caps.dtypes]
    if missing:
        cfg = replace(base, dtype=missing[0])
        out.append((f"dtype-{SHORT_DTYPE[missing[0]]}", cfg, f"dtype {missing[0]}"))
    bad_head = None
    if caps.max_head_size is not None:
        bad_head = caps.max_head_size + 32
    elif caps.head_sizes is not None:
        bad_head = next(h for h in (72, 40, 48, 24, 112, 136, 200, 320) if h not in caps.head_sizes)
    if bad_head is not None:
        out.append((f"hd{bad_head}", replace(base, head_size=bad_head), f"head size {bad_head}"))
    if caps.block_sizes is not None:
        bad_block = next(b for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4) if b not in caps.block_sizes)
        out.append((f"bs{bad_block}", replace(base, block_size=bad_block), f"block size {bad_block}"))
    if not caps.gqa:
        h, kv = HEADS[2]
        out.append(("gqa2", replace(base, num_heads=h, num_kv_heads=kv), f"grouped-query attention ({h} query / {kv} KV heads)"))
    return out
