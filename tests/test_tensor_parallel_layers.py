"""Tensor-parallel sharding in one process: every rank's shard runs in its own thread, the collectives
are simulated by a barrier (sum / concatenate in rank order), and the result is compared with
Hugging Face transformers' float32 logits and with float64 products written here.

The real collectives (torch.distributed, gloo, separate processes) are tested in test_tensor_parallel.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from corerun.errors import ConfigError
from corerun.models import load_model
from corerun.models.config import ModelConfig
from corerun.models.layers import WeightShapeError
from corerun.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, attention_projections, mlp_projections
from corerun.distributed.sharding import check_model, shard_heads, shard_vocab, valid_sizes
from tests.helpers.tiny_models import corerun_logits, hf_logits, make_tiny_model, max_rel_err

TOL = 1e-5


class ThreadGroup:
    """``world_size`` ranks in threads of one process; collectives meet at a barrier."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def member(self, rank: int) -> "Member":
        return Member(self, rank)


class Member:
    def __init__(self, shared: ThreadGroup, rank: int) -> None:
        self.shared, self.rank, self.world_size = shared, rank, shared.world_size
        self.calls = 0

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.calls += 1
        self.shared.slots[self.rank] = x.detach().clone()
        self.shared.barrier.wait()
        parts = list(self.shared.slots)
        self.shared.barrier.wait()
        return parts  # type: ignore[return-value]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        return x.copy_(torch.stack(parts).double().sum(0).to(x.dtype))

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self._exchange(x)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def min_int(self, value: int) -> int:
        return int(torch.cat(self._exchange(torch.tensor([value]))).min())


class Follower(nn.Module):
    """A rank other than 0 seen by ``corerun_logits``: its logits are empty (rank 0 has them)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.num_layers = inner, inner.num_layers

    def forward(self, *args):
        return self.inner(*args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.inner.compute_logits(hidden) is None
        return torch.empty(hidden.shape[0], 0)

    def attention_spec(self, *args):
        return self.inner.attention_spec(*args)


def _run_ranks(fn, world_size: int) -> list:
    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(fn, range(world_size)))


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("hq,hkv,n", [(8, 8, 2), (8, 4, 4), (8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 1, 4), (4, 2, 4), (12, 3, 6)])
def test_every_rank_holds_the_kv_heads_its_query_heads_use(hq, hkv, n):
    group = hq // hkv
    seen_q = []
    for r in range(n):
        s = shard_heads(hq, hkv, r, n)
        q = list(range(s.q_start, s.q_start + s.num_heads))
        kv = list(range(s.kv_start, s.kv_start + s.num_kv_heads))
        seen_q += q
        assert sorted({h // group for h in q}) == kv  # exactly the KV heads its queries need
        assert s.num_heads % s.num_kv_heads == 0
    assert seen_q == list(range(hq))


def test_vocab_ranges_cover_the_vocabulary_once():
    for vocab, n in [(254, 4), (256, 2), (7, 4), (49152, 8)]:
        shards = [shard_vocab(vocab, r, n) for r in range(n)]
        rows = [i for s in shards for i in range(s.start, s.end)]
        assert rows == list(range(vocab))
        assert all(s.rows_per_rank * n >= vocab for s in shards)


def test_sizes_that_cannot_split_a_model_are_refused_with_the_sizes_that_can():
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    })
    assert valid_sizes(config) == [1, 2, 4]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 .*num_attention_heads 4.*Sizes that work for it: 1, 2, 4"):
        check_model(config, 3)
    with pytest.raises(ConfigError, match="must divide intermediate_size 102"):
        check_model(ModelConfig.from_dict({**config.raw, "intermediate_size": 102}), 4)
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        shard_heads(12, 3, 0, 4)


# ------------------------------------------------------------------ single layers vs float64
def test_column_and_row_parallel_projections_match_float64():
    torch.manual_seed(0)
    hidden, d, hq, hkv, inter = 24, 4, 4, 2, 40
    wq, wk, wv = torch.randn(hq * d, hidden), torch.randn(hkv * d, hidden), torch.randn(hkv * d, hidden)
    bq, bk, bv = torch.randn(hq * d), torch.randn(hkv * d), torch.randn(hkv * d)
    wo, bo = torch.randn(hidden, hq * d), torch.randn(hidden)
    wg, wu, wd = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(5, hidden)
    xd = x.double()
    q_ref, k_ref, v_ref = (xd @ w.double().T + b.double() for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    mlp_in = torch.nn.functional.silu(xd @ wg.double().T) * (xd @ wu.double().T)

    for n in (2, 4):  # 4 ranks, 2 KV heads: each KV head held by two ranks
        shared = ThreadGroup(n)

        def rank_outputs(r):
            tp = shared.member(r)
            qkv, o = attention_projections(hidden, d, hq, hkv, shard_heads(hq, hkv, r, n), True, True, tp)
            gate_up, down = mlp_projections(hidden, inter, False, tp)
            for layer in (qkv, o, gate_up, down):
                for p in layer.parameters():
                    p.data.fill_(float("nan"))  # every element must be loaded
            for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
                qkv.weight.weight_loader(qkv.weight, w, shard)
                qkv.bias.weight_loader(qkv.bias, b, shard)
            o.weight.weight_loader(o.weight, wo)
            o.bias.weight_loader(o.bias, bo)
            gate_up.weight.weight_loader(gate_up.weight, wg, "gate")
            gate_up.weight.weight_loader(gate_up.weight, wu, "up")
            down.weight.weight_loader(down.weight, wd)
            q, k, v = qkv.split(qkv(x))
            local = inter // n
            gate, up = gate_up(x).split(local, dim=-1)
            attn_out = o(q_ref[:, r * (hq // n) * d : (r + 1) * (hq // n) * d].float())
            mlp_out = down((torch.nn.functional.silu(gate) * up))
            return q, k, v, attn_out, mlp_out

        outs = _run_ranks(rank_outputs, n)
        for r, (q, k, v, attn_out, mlp_out) in enumerate(outs):
            s = shard_heads(hq, hkv, r, n)
            assert max_rel_err(q, q_ref[:, s.q_start * d : (s.q_start + s.num_heads) * d]) < TOL
            kv_cols = slice(s.kv_start * d, (s.kv_start + s.num_kv_heads) * d)
            assert max_rel_err(k, k_ref[:, kv_cols]) < TOL and max_rel_err(v, v_ref[:, kv_cols]) < TOL
            assert max_rel_err(attn_out, q_ref @ wo.double().T + bo.double()) < TOL  # summed over ranks
            assert max_rel_err(mlp_out, mlp_in @ wd.double().T) < TOL


def test_vocab_parallel_embedding_and_head_pad_the_last_range():
    vocab, hidden, n = 10, 6, 4  # 3 rows per rank; the last rank holds 1 row and 2 zero rows
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 9, 3, 7, 7, 5])
    h = torch.randn(3, hidden)
    shared = ThreadGroup(n)

    def rank_outputs(r):
        tp = shared.member(r)
        emb, head = VocabParallelEmbedding(vocab, hidden, tp), ParallelLMHead(vocab, hidden, tp)
        head.tie_to(emb)
        emb.weight.data.fill_(float("nan"))
        emb.weight.weight_loader(emb.weight, table)
        return emb(ids), head(h)

    outs = _run_ranks(rank_outputs, n)
    for r, (embedded, logits) in enumerate(outs):
        assert torch.equal(embedded, table[ids])
        assert (logits is None) == (r != 0)
    assert outs[0][1].shape == (3, vocab) and outs[0][1].dtype == torch.float32
    assert max_rel_err(outs[0][1], h.double() @ table.double().T) < TOL


def test_a_checkpoint_tensor_of_the_wrong_size_is_refused_with_the_full_shape():
    tp = ThreadGroup(2).member(0)
    qkv, o = attention_projections(16, 4, 4, 2, shard_heads(4, 2, 0, 2), False, False, tp)
    with pytest.raises(WeightShapeError, match=r"expected shape \(16, 16\), checkpoint has \(12, 16\)"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(12, 16), "q")
    with pytest.raises(WeightShapeError, match=r"expected shape \(16, 16\)"):
        o.weight.weight_loader(o.weight, torch.randn(16, 8))
    emb = VocabParallelEmbedding(10, 4, tp)
    with pytest.raises(WeightShapeError, match=r"expected shape \(10, 4\)"):
        emb.weight.weight_loader(emb.weight, torch.randn(5, 4))


# ------------------------------------------------------------------ whole models vs Hugging Face
@pytest.mark.parametrize(
    "arch,overrides,n",
    [
        pytest.param("llama", {"vocab_size": 254}, 2, id="llama-tp2"),
        pytest.param("llama", {"vocab_size": 254}, 4, id="llama-tp4-kv-replicated"),
        pytest.param("llama", {"num_key_value_heads": 1}, 4, id="llama-tp4-one-kv-head"),
        pytest.param("qwen2", {"tie_word_embeddings": True}, 2, id="qwen2-bias-tied-tp2"),
        pytest.param("qwen3", {}, 4, id="qwen3-tp4"),
    ],
)
def test_sharded_model_matches_hf(tmp_path, arch, overrides, n):
    folder = make_tiny_model(tmp_path, arch, **overrides)
    vocab = overrides.get("vocab_size", 256)
    ids = _prompt(19, vocab, seed=n)
    ref = hf_logits(folder, ids)
    shared = ThreadGroup(n)
    members = [shared.member(r) for r in range(n)]

    def rank_logits(r):
        model, config = load_model(folder, dtype="float32", tp=members[r])
        spec = model.attention_spec(torch.float32, 4, "cpu")
        kv_heads = config.num_kv_heads
        assert (spec.num_heads, spec.num_kv_heads) == (config.num_heads // n, max(1, kv_heads // n))
        runnable = model if r == 0 else Follower(model)
        return corerun_logits(runnable, ids, block_size=4, chunks=[6, 1, 1, 9, 1, 1])

    logits = _run_ranks(rank_logits, n)
    assert max_rel_err(logits[0], ref) < TOL
    assert all(m.calls == members[0].calls > 0 for m in members)  # the ranks met at every collective


# ------------------------------------------------------------------ KV cache size
def test_ranks_agree_on_the_smallest_block_count_before_any_allocates(tmp_path, monkeypatch):
    """Ranks that would size their KV caches differently (here: rank 1's budget is smaller) allocate the
    smallest count, each exactly once, and each makes its KV-cache manager once, with that count."""
    from corerun.attention.torch_backend import TorchAttentionBackend
    from corerun.config import load_config
    from corerun.kv_cache.paged import PagedKVCacheManager
    from corerun.runner.model_runner import ModelRunner

    folder = make_tiny_model(tmp_path, "llama")
    allocated: list[int] = []
    managed: list[int] = []
    real_allocate, real_manager = TorchAttentionBackend.allocate_kv_cache, PagedKVCacheManager.__init__

    def allocate(self, num_blocks):
        allocated.append(num_blocks)
        return real_allocate(self, num_blocks)

    def manager(self, num_blocks, *args, **kwargs):
        managed.append(num_blocks)
        real_manager(self, num_blocks, *args, **kwargs)

    monkeypatch.setattr(TorchAttentionBackend, "allocate_kv_cache", allocate)
    monkeypatch.setattr(PagedKVCacheManager, "__init__", manager)
    shared = ThreadGroup(2)
    budgets = [40, 24]  # blocks each rank's memory would hold

    def build(r):
        config = load_config(None, overrides={
            "model": str(folder), "device": "cpu", "dtype": "float32", "attention": "torch", "tensor_parallel_size": 2,
            "kv_cache": {"block_size": 4, "num_blocks": budgets[r]}, "scheduler": {"max_model_len": 64},
        })
        runner = ModelRunner(config, tp=shared.member(r))
        blocks_held = [t.shape[1] - 1 for t in runner.kv_caches]  # [2, blocks + a write-off block, ...]
        return runner.num_blocks, runner.kv_manager.num_free_blocks, blocks_held

    layers = ModelConfig.from_model_dir(folder).num_layers
    assert _run_ranks(build, 2) == [(24, 24, [24] * layers)] * 2
    assert allocated == [24] * (2 * layers)  # no rank allocated its own count first
    assert managed == [24, 24]
