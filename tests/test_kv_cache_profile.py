"""The step-memory profile behind ``kv_cache.num_blocks: auto`` on CUDA: the worst prefill's shape,
the dummy step's layout, and the runner keeping the measured peaks out of the KV budget (measured on
CPU with the peak measurement faked: the runs are real, only the byte counts are chosen)."""

from __future__ import annotations

import pytest
import torch

from corerun.config import Config
from corerun.kv_cache import profile
from corerun.model_runner import ModelRunner
from tests.helpers.tiny_models import make_tiny_model

MiB, GiB = 1 << 20, 1 << 30
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("budget", "max_len", "max_seqs", "expected"),
    [
        (8192, 2048, 256, [2048, 2048, 2048, 2048]),
        (100, 2048, 256, [100]),
        (5000, 2048, 256, [2048, 2048, 904]),
        (10_000, 4096, 2, [4096, 4096]),  # max_num_seqs caps the requests
    ],
)
def test_prefill_lengths_fill_the_budget_with_the_longest_requests(budget, max_len, max_seqs, expected) -> None:
    assert profile.prefill_lengths(budget, max_len, max_seqs) == expected


def test_dummy_step_lays_requests_out_in_consecutive_blocks_decodes_first() -> None:
    inputs, blocks = profile.dummy_step([5, 1, 9], block_size=4, device=CPU)
    b = inputs.batch
    # sorted decodes first: [1, 5, 9] -> 1, 2 and 3 blocks starting at blocks 0, 1 and 3
    assert blocks == 6 and (b.num_reqs, b.num_tokens, b.num_decodes, b.max_query_len, b.max_seq_len) == (3, 15, 1, 9, 9)
    assert b.query_start_loc.tolist() == [0, 1, 6, 15] and b.seq_lens.tolist() == [1, 5, 9]
    assert b.context_lens.tolist() == [0, 0, 0]
    assert b.block_tables.tolist() == [[0, 0, 0], [1, 2, 0], [3, 4, 5]]
    assert b.slot_mapping.tolist() == [0] + list(range(4, 9)) + list(range(12, 21))
    assert inputs.positions.tolist() == [0] + list(range(5)) + list(range(9))
    assert inputs.input_ids.shape == (15,)


def test_dummy_decode_is_shaped_like_a_captured_one() -> None:
    inputs, blocks = profile.dummy_step([1] * 3, block_size=16, device=CPU, table_width=8, max_seq_len=128)
    b = inputs.batch
    assert blocks == 3 and b.block_tables.shape == (3, 8) and b.max_seq_len == 128 and b.is_pure_decode
    assert b.slot_mapping.tolist() == [0, 16, 32]


def test_peak_bytes_off_cuda_runs_and_reports_zero() -> None:
    ran = []
    assert profile.peak_bytes(lambda: ran.append(1), CPU) == 0 and ran == [1]


def test_step_memory_reserve_is_the_larger_eager_peak_plus_the_graph_pool() -> None:
    m = profile.StepMemory(prefill_bytes=300, sampling_bytes=500, graph_bytes=70, prefill_tokens=8, prefill_requests=1)
    assert m.reserved_bytes == 570


def test_runner_keeps_the_profiled_peaks_out_of_the_kv_budget(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner profiles (forced on here), runs the real steps, and sizes the cache from what is left."""
    model_dir = make_tiny_model(tmp_path)
    runs: list[object] = []
    fake_peaks = iter([7 * MiB, 3 * MiB])  # prefill, then sampling (no graph pool: eager on CPU)

    def fake_peak(run, device):
        runs.append(run())
        return next(fake_peaks)

    monkeypatch.setattr(ModelRunner, "_profiles_step_memory", lambda self: True)
    monkeypatch.setattr(profile, "peak_bytes", fake_peak)
    config = Config(
        model=str(model_dir), device="cpu", dtype="float32", attention="torch",
        kv_cache={"block_size": 16, "num_blocks": "auto", "cpu_memory_gb": 0.0625},
        scheduler={"max_model_len": 96, "max_num_batched_tokens": 200, "max_num_seqs": 5},
    )
    runner = ModelRunner(config)

    # the prefill really ran: 200 tokens in requests of at most max_model_len (96 + 96 + 8)
    hidden = runs[0]
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (200, 64) and torch.isfinite(hidden).all()
    assert runner.step_memory is not None and runner.step_memory.prefill_tokens == 200
    assert (runner.step_memory.prefill_requests, runner.step_memory.graph_bytes) == (3, 0)
    # K and V, 16 slots, 2 KV heads of 16 dims, float32, 2 layers
    per_block = 2 * 16 * 2 * 16 * 4 * 2
    assert runner.num_blocks == (GiB // 16 - 7 * MiB) // per_block
    # the scratch cache is gone: each layer's cache holds the sized blocks (torch adds one write-off block)
    assert len(runner.kv_caches) == 2
    assert all(runner.num_blocks * per_block // 2 <= c.numel() * 4 <= (runner.num_blocks + 1) * per_block // 2 for c in runner.kv_caches)


def test_generation_after_profiling_equals_generation_without(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch cache of the profile leaves nothing behind: greedy tokens are those of a plain runner."""
    from corerun import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path)
    common = dict(model=str(model_dir), device="cpu", dtype="float32", attention="torch",
                  kv_cache={"block_size": 16, "cpu_memory_gb": 0.01}, scheduler={"max_model_len": 96, "max_num_batched_tokens": 64})
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[3, 4, 5], list(range(10, 40))]
    plain = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setattr(ModelRunner, "_profiles_step_memory", lambda self: True)
    profiled = LLM(**common)
    assert profiled.engine.runner.step_memory is not None
    assert [o.outputs[0].token_ids for o in profiled.generate(prompts, sp, use_tqdm=False)] == plain
