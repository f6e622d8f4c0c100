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


@pytest.mark.parametrize("bypassed", ["silu_and_mul", "write_kv"])
def test_a_call_outside_the_tape_is_caught(bypassed: str, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """A C call made directly, not through ``native`` (a fused op's; the K/V write, whose absence only a later
    attention would show): the check refuses every bucket, the steps run eagerly, and the output is the eager one."""
    pytest.importorskip("corerun_attention_cpu")
    from corerun_attention_cpu import backend, fused_ops

    eager_tokens, _, _ = _generate(2, attention="cpu", fused_ops="cpu", graph={"runner": {"name": "eager"}})
    module, name = (fused_ops, "corerun_cpu_silu_and_mul") if bypassed == "silu_and_mul" else (backend, "corerun_cpu_write_kv")
    kept = module.native

    def native(fn, *args, **kw):  # type: ignore[no-untyped-def]
        return fn(*args) if getattr(fn, "__name__", "") == name else kept(fn, *args, **kw)

    monkeypatch.setattr(module, "native", native)
    with caplog.at_level(logging.WARNING, logger="corerun.graph"):
        tokens, _, (replays, sizes, refusals) = _generate(2, attention="cpu", fused_ops="cpu",
                                                          graph={"runner": {"name": "replay"}})
    assert sizes == [] and replays == 0
    assert sorted(refusals) == [1, 2, 4, 8] and all("differs from the eager one" in r for r in refusals.values())
    assert "4 of 4 buckets run eagerly" in caplog.text
    assert tokens == eager_tokens


def test_reading_the_data_in_python_is_refused_on_the_recording_thread_only() -> None:
    import threading

    x = torch.arange(4)
    for read in (torch.Tensor.tolist, torch.Tensor.numpy):
        with pytest.raises(NotRecordable, match="read the data"):
            with record():
                read(x)
    seen: list = []
    with record():
        other = threading.Thread(target=lambda: seen.append(x.tolist()))  # another thread is not recording
        other.start()
        other.join()
    assert seen == [[0, 1, 2, 3]] and x.tolist() == [0, 1, 2, 3]


def test_a_thread_count_is_read_again_at_each_replay() -> None:
    got: list[tuple] = []

    def kernel(*args: int) -> int:
        got.append(args)
        return 0

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with record() as tape:
            native(kernel, 7, 1, 9, threads_at=-2)
            native(kernel, 7, 1, 9)
        torch.set_num_threads(2)
        tape.replay()
    finally:
        torch.set_num_threads(saved)
    assert got == [(7, 1, 9), (7, 1, 9), (7, 2, 9), (7, 1, 9)]


def test_a_bucket_whose_check_cannot_run_stays_eager() -> None:
    """Six blocks: the checks of 4 and 8 requests need 8 and 16 (two a row); those buckets run eagerly, 1 and 2 replay."""
    pytest.importorskip("corerun_attention_cpu")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for runner in ("eager", "replay"):
        with make_llm(attention="cpu", kv_cache={"num_blocks": 6}, graph={"runner": {"name": runner}}) as llm:
            outs[runner] = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
            graph = llm.engine.runner.graph
            if runner == "replay":
                assert sorted(graph._graphs) == [1, 2] and sorted(graph.refusals) == [4, 8]
                assert all("ValueError" in r and "block" in r for r in graph.refusals.values())
                assert graph.stats.replays >= 4
    assert outs["replay"] == outs["eager"]


def test_lora_steps_are_not_recorded_and_auto_keeps_eager() -> None:
    pytest.importorskip("corerun_attention_cpu")
    lora = {"enabled": True, "max_lora_rank": 8}
    with make_llm(graph={"runner": {"name": "replay"}}, attention="cpu", lora=lora) as llm:
        graph = llm.engine.runner.graph
        assert graph._graphs == {}
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert graph.stats.fallbacks.get("not_recorded", 0) >= 3 and "not_captured" not in graph.stats.fallbacks
    with make_llm(attention="cpu", lora=lora) as llm:  # graph.runner: auto
        assert llm.engine.runner.graph_name == "eager"
    with make_llm(attention="cpu") as llm:
        assert llm.engine.runner.graph_name == "replay"


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
    monkeypatch.setattr(backend, "native", lambda fn, *args, **_: fn(*args))
    results, _ = run_suite("graph:replay", attention="cpu", keyword="decode_matches_eager")
    bad = failed(results)
    assert set(bad) == {"decode_matches_eager"}
    assert "declares replay_decode, yet the runner recorded []" in bad["decode_matches_eager"][0].reason
