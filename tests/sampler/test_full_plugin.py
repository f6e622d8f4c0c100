"""The built-in full sampler: registration, capabilities, check(), options, no host sync."""

from __future__ import annotations

import math

import pytest
import torch

from corerun import PluginError, UnsupportedError
from corerun.protocols import Sampler
from corerun.plugin.registry import Registry
from corerun.sampling_params import SamplingParams as SP
from corerun.sampler import options as plugin
from corerun.sampler.full import FullSampler

V = 32

EVERYTHING = SP(
    temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
    repetition_penalty=1.1, seed=3, max_tokens=8, min_tokens=2, stop_token_ids=[4], logprobs=3,
    prompt_logprobs=2, logit_bias={1: -math.inf, 2: 1.0}, ignore_eos=True,
)


def test_registered_as_a_builtin_with_no_plugin_allowed() -> None:
    registry = Registry.from_environment(allow=[])  # no installed plugin: the core alone
    registration = registry.get("sampler", "full")
    assert (registration.distribution, registration.origin) == ("corerun", "built-in")
    assert registration.capabilities is plugin.CAPABILITIES is FullSampler.capabilities
    sampler = registry.create("sampler", "full", V, torch.device("cpu"), options={"logprobs_mode": "processed"})
    assert isinstance(sampler, FullSampler) and isinstance(sampler, Sampler)
    assert sampler.name == "full" and sampler.options.logprobs_mode == "processed"
    with pytest.raises(PluginError, match="logprobs_mode"):
        registry.create("sampler", "full", V, torch.device("cpu"), options={"logprobs_mode": "logits"})


def test_options_are_validated_on_direct_construction() -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        FullSampler(V, "cpu", logprobs_mode="bogus")
    with pytest.raises(ValueError, match="colour"):
        FullSampler(V, "cpu", colour="blue")


def test_check_accepts_every_parameter() -> None:
    FullSampler(V, "cpu").check(EVERYTHING)
    assert plugin.CAPABILITIES.check(EVERYTHING) == []


def test_check_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary \[0, 32\): \[40\]"):
        FullSampler(V, "cpu").check(SP(logit_bias={40: 1.0}))


def test_check_names_a_parameter_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    narrower = type(plugin.CAPABILITIES)(params=plugin.HONOURED - {"min_p", "seed"})
    monkeypatch.setattr(FullSampler, "capabilities", narrower)
    with pytest.raises(UnsupportedError, match=r"sampler 'full': does not honour min_p=0.05, seed=3"):
        FullSampler(V, "cpu").check(EVERYTHING)


def test_sample_reads_no_tensor_value_on_the_host(ref, monkeypatch: pytest.MonkeyPatch, forbid_host_sync) -> None:
    """A CPU stand-in for CUDA's sync check: no .item(), no bool(tensor), no .tolist() anywhere in ``sample``."""
    params = [EVERYTHING, SP(temperature=0, logprobs=1), SP(top_p=0.5), SP(seed=1), SP(min_p=0.2)]
    logits = torch.randn(len(params), V)
    md = ref.metadata(params, [[1, 2, 3]] * 5, [[3], [], [5, 5], [1], []], frozenset({0}))
    forbid_host_sync()
    out = FullSampler(V, "cpu").sample(logits, md)
    monkeypatch.undo()
    assert out.sampled_token_ids.shape == (len(params),)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sample_does_not_synchronize(ref) -> None:
    params = [EVERYTHING, SP(temperature=0, logprobs=1), SP(top_p=0.5), SP(seed=1), SP(min_p=0.2)]
    md = ref.metadata(params, [[1, 2, 3]] * 5, [[3], [], [5, 5], [1], []], frozenset({0}))
    sampler = FullSampler(V, "cuda")
    logits = torch.randn(len(params), V, device="cuda")
    sampler.sample(logits, md)  # warm-up: allocator, generators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = FullSampler(V, "cpu")
    greedy = out.sampled_token_ids[1].item()
    assert greedy == cpu.sample(logits.cpu(), md).sampled_token_ids[1].item()
