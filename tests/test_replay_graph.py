"""The ``replay`` graph runner and its tape (corerun.protocols.replay).

The tape is checked against closed forms in float64 on inputs changed after recording; the runner against
the ``eager`` runner's tokens and log-probabilities on the same engine settings (eager is the path the model
suites check against transformers), on batch sizes that fill and pad its buckets.  A component that computes
outside the tape's sight must be caught by the runner's check, and the step must still come out right.
"""

from __future__ import annotations

import ctypes
import gc
import logging

import pytest
import torch

from corerun.errors import ConfigError
from corerun.graph.replay import ReplayGraphRunner
from corerun.protocols.graph import GraphLimits
from corerun.protocols.replay import NotRecordable, native, record, recording
from corerun.sampling_params import SamplingParams
from corerun.testing.engines import make_llm

memmove = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A C call torch does not see (libc's memmove through ctypes), made through ``native``."""
    native(memmove, dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


# ------------------------------------------------------------------- the tape
def test_tape_replays_operators_on_new_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = torch.randn(4, 5, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)

    def step() -> torch.Tensor:
        y = torch.nn.functional.linear(x, w)  # returns a new tensor: replayed into the recorded one
        y.mul_(2.0)  # writes its argument: replayed as called
        z = torch.empty_like(y)
        torch.add(y, b, out=z)  # an out= call
        return z.relu()[:, 1:]  # a new tensor, then a view of it

    with record() as tape:
        out = step()
    assert len(tape) == 4
    for _ in range(3):
        x.copy_(torch.randn(3, 5, generator=g, dtype=torch.float64))
        out.fill_(float("nan"))
        tape.replay()
        expected = (2.0 * (x.numpy() @ w.numpy().T) + b.numpy()).clip(min=0.0)[:, 1:]
        torch.testing.assert_close(out, torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


def test_native_calls_are_kept_and_direct_ones_are_not() -> None:
    src = torch.randn(64, dtype=torch.float32)
    seen, unseen = torch.zeros(64), torch.zeros(64)
    with record() as tape:
        assert recording() is tape
        _copy_bytes(seen, src)
        memmove(unseen.data_ptr(), src.data_ptr(), 256)  # the mistake the runner's check is there for
    assert recording() is None
    assert len(tape) == 1
    first = src.clone()
    src.copy_(torch.randn(64))
    tape.replay()
    assert torch.equal(seen, src)
    assert torch.equal(unseen, first)  # stale: the tape never saw it


def test_tensors_made_while_recording_stay_put() -> None:
    src = torch.arange(32, dtype=torch.float32)
    out = torch.zeros(32)
    with record() as tape:
        scratch = torch.empty(32)  # only the tape refers to it after the block
        _copy_bytes(scratch, src)
        _copy_bytes(out, scratch)
        address = scratch.data_ptr()
        del scratch
    gc.collect()
    assert any(t.data_ptr() == address for t in tape.held)
    src.mul_(3.0)
    out.zero_()
    tape.replay()
    assert torch.equal(out, torch.arange(32, dtype=torch.float32) * 3.0)


@pytest.mark.parametrize("what", ["item", "nonzero", "randn", "bernoulli"])
def test_data_dependent_work_is_refused(what: str) -> None:
    x = torch.randn(8)
    with pytest.raises(NotRecordable, match="depends on the data"):
        with record():
            if what == "item":
                x.sum().item()
            elif what == "nonzero":
                torch.nonzero(x > 0)
            elif what == "randn":
                torch.randn(3)
            else:
                torch.bernoulli(torch.full((4,), 0.5))


def test_nested_recording_is_refused() -> None:
    with record():
        with pytest.raises(RuntimeError, match="already recording"):
            with record():
                pass
    assert recording() is None


def test_native_check_runs_at_replay() -> None:
    code = [0]
    errors: list[int] = []

    def kernel() -> int:
        return code[0]

    with record() as tape:
        native(kernel, check=errors.append)
    assert errors == []
    code[0] = 7
    tape.replay()
    assert errors == [7]


# ----------------------------------------------------------------- the runner
def _limits(device: str = "cpu") -> GraphLimits:
    return GraphLimits(8, 64, 4, 16, torch.float32, torch.device(device))


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_batch_size.*got 0"):
        ReplayGraphRunner(lambda *a: None, object(), _limits(), max_batch_size=0)
    with pytest.raises(ConfigError, match="runs on the CPU"):
        ReplayGraphRunner(lambda *a: None, object(), _limits("meta"))


PROMPTS = [[3, 14, 15, 9, 2, 6], [27, 18, 28], [1, 41, 42, 13, 5, 8, 9, 7, 9], [31, 4], [16, 17, 18, 19, 20]]


def _generate(n: int, **overrides: object) -> tuple[list[list[int]], list[list[float]], object]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    with make_llm(scheduler={"max_num_seqs": 8}, **overrides) as llm:
        outs = llm.generate(PROMPTS[:n], params, use_tqdm=False)
        graph = llm.engine.runner.graph
        stats = (graph.stats.replays, sorted(getattr(graph, "_graphs", {})), dict(getattr(graph, "refusals", {})))
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs, stats


@pytest.mark.parametrize("attention", ["torch", "cpu"])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_replay_matches_eager(attention: str, n: int) -> None:
    if attention == "cpu":
        pytest.importorskip("corerun_attention_cpu")
    eager_tokens, eager_lp, _ = _generate(n, attention=attention, graph={"runner": {"name": "eager"}})
    tokens, lp, (replays, sizes, refusals) = _generate(n, attention=attention, graph={"runner": {"name": "replay"}})
    assert refusals == {} and sizes == [1, 2, 4, 8]
    assert replays >= 10  # every decode step after the prompts
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_a_call_outside_the_tape_is_caught(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fused op that calls C directly (not through ``native``): the check refuses every bucket, the steps run
    eagerly, and the output is still the eager one."""
    pytest.importorskip("corerun_attention_cpu")
    from corerun_attention_cpu.fused_ops import CpuFusedOps

    def silu_and_mul(self: CpuFusedOps, x: torch.Tensor) -> torch.Tensor:
        tokens, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty((tokens, inter), dtype=x.dtype)
        self._silu_and_mul(0, x.data_ptr(), tokens, x.stride(0), inter, out.data_ptr(), 1)
        return out

    eager_tokens, _, _ = _generate(2, attention="cpu", fused_ops="cpu", graph={"runner": {"name": "eager"}})
    monkeypatch.setattr(CpuFusedOps, "silu_and_mul", silu_and_mul)
    with caplog.at_level(logging.WARNING, logger="corerun.graph"):
        tokens, _, (replays, sizes, refusals) = _generate(2, attention="cpu", fused_ops="cpu",
                                                          graph={"runner": {"name": "replay"}})
    assert sizes == [] and replays == 0
    assert sorted(refusals) == [1, 2, 4, 8] and all("differs from the eager one" in r for r in refusals.values())
    assert "4 of 4 buckets run eagerly" in caplog.text
    assert tokens == eager_tokens


def test_lora_steps_are_not_recorded() -> None:
    with make_llm(graph={"runner": {"name": "replay"}}, lora={"enabled": True, "max_lora_rank": 8}) as llm:
        assert llm.engine.runner.graph._graphs == {}
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_replay_with_a_quantized_kv_cache(kv_dtype: str) -> None:
    """The K/V quantized in torch before the C write: replayed as the operators it is, the same tokens as eager."""
    pytest.importorskip("corerun_attention_cpu")
    kv = {"kv_cache": {"dtype": kv_dtype}, "attention": "cpu"}
    eager_tokens, _, _ = _generate(3, graph={"runner": {"name": "eager"}}, **kv)
    tokens, _, (replays, sizes, refusals) = _generate(3, graph={"runner": {"name": "replay"}}, **kv)
    assert refusals == {} and sizes == [1, 2, 4, 8] and replays >= 10
    assert tokens == eager_tokens


def test_graph_suite_rejects_a_false_replay_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu backend with its C calls made directly (what a backend that declares replay_decode without routing
    them through ``native`` does): the runner refuses every bucket, and ``corerun conformance graph:replay
    --attention cpu`` fails the declaration.  Unpatched, the same run passes."""
    pytest.importorskip("corerun_attention_cpu")
    from corerun.conformance.runner import run_suite
    from corerun_attention_cpu import backend

    def failed(results: list) -> dict[str, list]:
        out: dict[str, list] = {}
        for r in results:
            if r.outcome == "failed":
                out.setdefault(r.check, []).append(r)
        return out

    results, _ = run_suite("graph:replay", attention="cpu", keyword="decode_matches_eager")
    assert results and not failed(results)
    monkeypatch.setattr(backend, "native", lambda fn, *args, check=None: fn(*args))
    results, _ = run_suite("graph:replay", attention="cpu", keyword="decode_matches_eager")
    bad = failed(results)
    assert set(bad) == {"decode_matches_eager"}
    assert "declares replay_decode, yet the runner recorded []" in bad["decode_matches_eager"][0].reason
