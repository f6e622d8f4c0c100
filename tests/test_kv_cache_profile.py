"""The step-memory profile behind ``kv_cache.num_blocks: auto`` on CUDA: the worst prefill's shape,
the dummy step's layout, and the runner keeping the measured peaks out of the KV budget (measured on
CPU with the peak measurement faked: the runs are real, only the byte counts are chosen)."""

from __future__ import annotations

import pytest
import torch

from corerun.config import Config
from corerun.runner import construction, profile
from corerun.runner.model_runner import ModelRunner
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


def test_worst_prefill_is_the_last_chunk_of_the_longest_prompts() -> None:
    """Shapes only: contexts reach max_model_len, every table entry and every write is block 0."""
    inputs = profile.worst_prefill(200, 96, 5, block_size=16, device=CPU)
    b = inputs.batch
    # 200 tokens: 96 + 96 + 8, each ending at position 95
    assert (b.num_reqs, b.num_tokens, b.num_decodes, b.max_query_len, b.max_seq_len) == (3, 200, 0, 96, 96)
    assert b.query_start_loc.tolist() == [0, 96, 192, 200] and b.seq_lens.tolist() == [96, 96, 96]
    assert b.context_lens.tolist() == [0, 0, 88]
    assert b.block_tables.shape == (3, 6) and not b.block_tables.any()
    assert inputs.positions.tolist() == list(range(96)) * 2 + list(range(88, 96))
    assert b.slot_mapping.tolist() == [p % 16 for p in inputs.positions.tolist()]
    assert b.query_start_loc_cpu.tolist() == [0, 96, 192, 200] and b.seq_lens_cpu.tolist() == [96, 96, 96]


def test_a_one_token_remainder_is_ordered_first_as_a_decode() -> None:
    b = profile.worst_prefill(97, 96, 5, block_size=16, device=CPU).batch
    assert b.num_decodes == 1 and b.query_start_loc.tolist() == [0, 1, 97] and b.context_lens.tolist() == [95, 0]


def test_widest_decode_reaches_max_model_len() -> None:
    inputs = profile.widest_decode(4, 100, block_size=16, device=CPU)
    b = inputs.batch
    assert b.is_pure_decode and b.num_reqs == 4 and b.max_seq_len == 100 and b.block_tables.shape == (4, 7)
    assert b.seq_lens_cpu.tolist() == [100] * 4 and inputs.positions.tolist() == [99] * 4
    assert b.slot_mapping.tolist() == [99 % 16] * 4


def test_captured_decode_plans_as_the_capture_does() -> None:
    """The profiled graph decode is the runner's own static batch: the torch backend, which sizes a
    decode by the host copies when they exist, must gather max_model_len keys here as in a capture."""
    from corerun.attention.torch_backend import TorchAttentionBackend
    from corerun.graph.static_inputs import StaticDecodeInputs
    from corerun.protocols.attention import AttentionSpec
    from corerun.protocols.graph import GraphLimits

    limits = GraphLimits(max_batch_size=8, max_model_len=4096, block_size=16, hidden_size=64, dtype=torch.float32, device=CPU)
    backend = TorchAttentionBackend(AttentionSpec(4, 2, 16, torch.float32, 16, CPU))
    profiled = profile.captured_decode(limits)
    captured = StaticDecodeInputs(limits).batch(8)
    assert backend.plan(profiled.batch).decode_len == backend.plan(captured).decode_len == 4096
    b = profiled.batch
    assert b.block_tables.shape == captured.block_tables.shape == (8, 256)
    assert (b.slot_mapping == -1).all() and b.seq_lens_cpu is None and b.query_start_loc_cpu is None


def test_peak_bytes_off_cuda_runs_and_reports_zero() -> None:
    ran = []
    assert profile.peak_bytes(lambda: ran.append(1), CPU) == 0 and ran == [1]


def test_step_memory_reserve_is_the_largest_eager_peak_plus_the_graph_pool() -> None:
    m = profile.StepMemory(300, 650, 500, 70, prefill_tokens=8, prefill_requests=1, decode_requests=4)
    assert m.reserved_bytes == 720


def test_runner_keeps_the_profiled_peaks_out_of_the_kv_budget(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner profiles (forced on here), runs the real steps, and sizes the cache from what is left."""
    model_dir = make_tiny_model(tmp_path)
    runs: list[object] = []
    fake_peaks = iter([7 * MiB, 5 * MiB, 3 * MiB])  # prefill, eager decode, sampling (no graph pool: eager on CPU)

    def fake_peak(run, device):
        runs.append(run())
        return next(fake_peaks)

    monkeypatch.setattr(construction, "profiles_step_memory", lambda device: True)
    monkeypatch.setattr(profile, "peak_bytes", fake_peak)
    config = Config(
        model=str(model_dir), device="cpu", dtype="float32", attention="torch",
        kv_cache={"block_size": 16, "num_blocks": "auto", "cpu_memory_gb": 0.0625},
        scheduler={"max_model_len": 96, "max_num_batched_tokens": 200, "max_num_seqs": 5},
    )
    runner = ModelRunner(config)

    # the prefill really ran: 200 tokens in requests of at most max_model_len (96 + 96 + 8), then the
    # decode of max_num_seqs requests; a zeroed scratch cache keeps the hidden states finite
    prefill, decode = runs[0], runs[1]
    assert isinstance(prefill, torch.Tensor) and prefill.shape == (200, 64) and torch.isfinite(prefill).all()
    assert isinstance(decode, torch.Tensor) and decode.shape == (5, 64) and torch.isfinite(decode).all()
    m = runner.step_memory
    assert m is not None and (m.prefill_tokens, m.prefill_requests, m.decode_requests, m.graph_bytes) == (200, 3, 5, 0)
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
    monkeypatch.setattr(construction, "profiles_step_memory", lambda device: True)
    profiled = LLM(**common)
    assert profiled.engine.runner.step_memory is not None
    assert [o.outputs[0].token_ids for o in profiled.generate(prompts, sp, use_tqdm=False)] == plain


@pytest.mark.parametrize(("sampler", "what"), [("full", "with every parameter"), ("basic", "temperature, seed")])
def test_sampling_profile_switches_on_what_the_sampler_accepts(tmp_path, sampler, what) -> None:
    model_dir = make_tiny_model(tmp_path)
    config = Config(model=str(model_dir), device="cpu", dtype="float32", attention="torch", sampler=sampler,
                    kv_cache={"num_blocks": 8}, scheduler={"max_model_len": 64})
    runner = ModelRunner(config)
    params, got = construction.widest_sampling(runner.sampler, runner.config.max_logprobs, 6)
    assert got == what
    greedy = [p for p in params if p.temperature == 0.0]
    assert len(greedy) == 3  # greedy rows mixed with sampled ones: both paths run
    for p in params:
        runner.sampler.check(p)
    if sampler == "full":
        rich = next(p for p in params if p.temperature > 0)
        assert rich.top_p < 1 and rich.top_k > 0 and rich.min_p > 0 and rich.repetition_penalty != 1
        assert rich.logprobs and rich.seed is not None and rich.logit_bias


def test_peak_memory_meter_keeps_the_mark_the_profile_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's high-water mark is faked: 9 GiB before the profile's reset, 5 GiB after it."""
    from corerun.bench.memory import PeakMemoryMeter

    mark = {"value": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: mark.update(value=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mark["value"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    cuda = torch.device("cuda", 0)
    meter = PeakMemoryMeter(cuda)
    meter.start()
    mark["value"] = 9 * GiB  # loading the weights peaks here
    before = profile.high_water(cuda)  # what the profile reads before it resets the mark
    profile.peak_bytes(lambda: mark.update(value=2 * GiB), cuda)
    mark["value"] = 5 * GiB  # serving afterwards
    assert meter.read().bytes == 5 * GiB  # the reset hid the load's peak ...
    assert meter.read(before).bytes == 9 * GiB  # ... which the profile's StepMemory.high_water_bytes gives back
    meter.start()
    mark["value"] = 3 * GiB
    assert meter.read().bytes == 3 * GiB


def test_the_profile_returns_the_high_water_mark_its_resets_hide(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each measurement resets the device's high-water mark; the mark read before each one comes back in
    ``StepMemory.high_water_bytes`` (their maximum), so a meter started before the load still sees it."""
    marks = iter([11 * MiB, 40 * MiB, 25 * MiB])  # before the prefill, the decode, the sampling
    monkeypatch.setattr(construction, "profiles_step_memory", lambda device: True)
    monkeypatch.setattr(profile, "peak_bytes", lambda run, device: (run(), MiB)[1])
    monkeypatch.setattr(profile, "high_water", lambda device: next(marks))
    config = Config(
        model=str(make_tiny_model(tmp_path)), device="cpu", dtype="float32", attention="torch",
        kv_cache={"block_size": 16, "num_blocks": "auto", "cpu_memory_gb": 0.0625},
        scheduler={"max_model_len": 64, "max_num_batched_tokens": 64, "max_num_seqs": 2},
    )
    assert ModelRunner(config).step_memory.high_water_bytes == 40 * MiB
