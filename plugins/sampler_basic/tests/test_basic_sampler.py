"""The basic sampler: greedy, temperature (chi-square against float64 softmax), seeds, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from corerun import UnsupportedError
from corerun.protocols import Sampler
from corerun.sdk import Registry
from corerun.sampling_params import SamplingParams as SP
from corerun_sampler_basic import plugin
from corerun_sampler_basic.sampler import BasicSampler

V = 48


def test_registered_through_the_entry_point() -> None:
    registry = Registry.from_environment(allow=["sampler_basic"])
    registration = registry.get("sampler", "basic")
    assert registration.distribution == "corerun-sampler-basic"
    assert registration.capabilities is plugin.CAPABILITIES is BasicSampler.capabilities
    sampler = registry.create("sampler", "basic", V, torch.device("cpu"))
    assert isinstance(sampler, BasicSampler) and isinstance(sampler, Sampler) and sampler.name == "basic"


def test_takes_no_options() -> None:
    with pytest.raises(ValueError, match=r"sampler 'basic' takes no options, got \['top_k'\]"):
        BasicSampler(V, "cpu", top_k=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(ref, dtype: torch.dtype) -> None:
    logits = (torch.randn(33, V, dtype=torch.float64) * 4).to(dtype)
    out = BasicSampler(V, "cpu").sample(logits, ref.metadata([SP(temperature=0)] * 33))
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.double().argmax(dim=-1))


def test_mixed_greedy_and_random_rows(ref) -> None:
    """Greedy rows are exact every time; the random rows of the same batch vary."""
    n = 64
    logits = torch.randn(n, V) * 0.5  # flat: random rows rarely repeat
    params = [SP(temperature=0) if i % 2 else SP(temperature=1.0) for i in range(n)]
    sampler = BasicSampler(V, "cpu")
    draws = torch.stack([sampler.sample(logits, ref.metadata(params)).sampled_token_ids for _ in range(5)])
    argmax = logits.double().argmax(dim=-1)
    assert torch.equal(draws[:, 1::2], argmax[1::2].expand(5, -1))
    assert (draws[:, 0::2] != argmax[0::2]).any()
    assert (draws[0, 0::2] != draws[1, 0::2]).any()


def test_tiny_temperature_is_greedy(ref) -> None:
    logits = torch.randn(8, V) * 3
    out = BasicSampler(V, "cpu").sample(logits, ref.metadata([SP(temperature=1e-7)] * 8))
    assert torch.equal(out.sampled_token_ids, logits.double().argmax(dim=-1))


def _chi2_bound(dof: int) -> float:
    """Upper 1e-4 quantile of chi-square(dof) (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_chi_square(ref, temperature: float) -> None:
    """40000 draws of one row against softmax(logits / T) in float64."""
    vocab, n = 12, 40_000
    logits = torch.randn(vocab, dtype=torch.float64) * 1.5
    want = torch.softmax(logits / temperature, dim=0)
    tokens = BasicSampler(vocab, "cpu").sample(
        logits.float().expand(n, vocab), ref.metadata([SP(temperature=temperature)] * n)
    ).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).double()
    chi2 = float(((counts - want * n) ** 2 / (want * n)).sum())
    assert chi2 < _chi2_bound(vocab - 1), (temperature, chi2)


def test_wrong_temperature_fails_the_chi_square(ref) -> None:
    """The test above can fail: draws at T=1.0 judged against T=1.15."""
    vocab, n = 12, 40_000
    logits = torch.randn(vocab, dtype=torch.float64) * 1.5
    want = torch.softmax(logits / 1.15, dim=0)
    tokens = BasicSampler(vocab, "cpu").sample(logits.float().expand(n, vocab), ref.metadata([SP()] * n)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert float(((counts - want * n) ** 2 / (want * n)).sum()) > _chi2_bound(vocab - 1)


def test_never_draws_a_token_of_probability_zero(ref) -> None:
    logits = torch.randn(4000, V)
    logits[:, 5] = -math.inf
    logits[:, 17] = -1e4  # exp underflows to 0 in float32
    tokens = BasicSampler(V, "cpu").sample(logits, ref.metadata([SP(temperature=1.5)] * 4000)).sampled_token_ids
    assert not ((tokens == 5) | (tokens == 17)).any()


def test_same_seed_same_tokens_alone_and_in_a_batch(ref) -> None:
    seeded = SP(temperature=0.9, seed=11)
    fixed = torch.randn(10, V)
    sampler = BasicSampler(V, "cpu")

    def run(rows: list[SP], position: int) -> list[int]:
        tokens = []
        for step in range(10):
            logits = torch.randn(len(rows), V)
            logits[position] = fixed[step]
            outputs = [[3] * step if i == position else [] for i in range(len(rows))]
            tokens.append(sampler.sample(logits, ref.metadata(rows, outputs)).sampled_token_ids[position].item())
        return tokens

    alone = run([seeded], 0)
    batch = run([SP(), SP(temperature=0), SP(seed=12), seeded, SP(temperature=2.0)], 3)
    assert alone == batch
    assert len(set(alone)) > 3


def test_seeded_noise_depends_on_seed_and_step(ref) -> None:
    logits = torch.zeros(1, V)
    sampler = BasicSampler(V, "cpu")
    draw = lambda seed, step: sampler.sample(logits, ref.metadata([SP(seed=seed)], [[0] * step])).sampled_token_ids.item()  # noqa: E731
    assert len({draw(5, step) for step in range(20)}) > 5
    assert len({draw(seed, 0) for seed in range(20)}) > 5


UNSUPPORTED = {
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "repetition_penalty": 1.2, "min_tokens": 2, "logprobs": 3, "prompt_logprobs": 1, "logit_bias": {3: 1.5},
}


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED.items(), ids=list(UNSUPPORTED))
def test_refuses_each_unsupported_parameter(field: str, value: object) -> None:
    with pytest.raises(UnsupportedError) as info:
        BasicSampler(V, "cpu").check(SP(**{field: value}))
    message = str(info.value)
    assert message.startswith(f"sampler 'basic': does not honour {field}={value!r}")
    assert "use `sampler: full` (built into corerun)" in message


def test_refusal_names_every_parameter() -> None:
    with pytest.raises(UnsupportedError) as info:
        BasicSampler(V, "cpu").check(SP(temperature=0.5, top_p=0.9, top_k=5, logprobs=2, seed=1))
    assert "does not honour logprobs=2, top_k=5, top_p=0.9;" in str(info.value)


def test_accepts_what_it_honours() -> None:
    sampler = BasicSampler(V, "cpu")
    for params in (SP(), SP(temperature=0), SP(temperature=1.7, seed=3), SP(max_tokens=3, ignore_eos=True, stop_token_ids=[2])):
        sampler.check(params)
    with pytest.raises(ValueError, match=r"stop_token_ids has token ids outside the vocabulary \[0, 48\): \[48\]"):
        sampler.check(SP(stop_token_ids=[48]))


def test_prompt_logprobs_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="does not compute prompt logprobs.*sampler: full"):
        BasicSampler(V, "cpu").prompt_logprobs(torch.randn(3, V), torch.zeros(3, dtype=torch.int64), 2)


def test_sample_reads_no_tensor_value_on_the_host(ref, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU stand-in for CUDA's sync check: no .item(), no bool(tensor), no .tolist() in ``sample``."""
    params = [SP(), SP(temperature=0), SP(seed=4), SP(temperature=0.3)]
    logits = torch.randn(4, V)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host while sampling")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = BasicSampler(V, "cpu").sample(logits, ref.metadata(params, [[], [], [1], []]))
    monkeypatch.undo()
    assert out.sampled_token_ids.shape == (4,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sample_does_not_synchronize(ref) -> None:
    params = [SP(), SP(temperature=0), SP(seed=4), SP(temperature=0.3)]
    sampler = BasicSampler(V, "cuda")
    logits = torch.randn(4, V, device="cuda")
    sampler.sample(logits, ref.metadata(params))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits, ref.metadata(params))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids[1].item() == logits[1].argmax().item()


def test_shape_error(ref) -> None:
    with pytest.raises(ValueError, match=r"\[batch_size=3, vocab_size=48\], got torch.float32 \[2, 48\]"):
        BasicSampler(V, "cpu").sample(torch.randn(2, V), ref.metadata([SP()] * 3))
