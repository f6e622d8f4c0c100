"""Listing, availability and refusal: the probe's reasons, the declared capabilities, UnsupportedError at construction."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import subprocess
import sys

import pytest
import torch

from corerun.errors import PluginUnavailableError, UnsupportedError
from corerun.protocols.attention import AttentionSpec
from corerun_attention_flash import probe as probe_module
from corerun_attention_flash.backend import FlashAttentionBackend
from corerun_attention_flash.capabilities import FLASH_CAPABILITIES
from corerun_attention_flash.testing import emulated


def spec(**overrides) -> AttentionSpec:
    base = dict(num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, block_size=256, device=torch.device("cuda"))
    return AttentionSpec(**{**base, **overrides})


def fake_machine(monkeypatch, *, fa2: bool, fa3: bool, cuda: tuple[int, int] | None) -> None:
    installed = {"flash_attn": fa2, "flash_attn_interface": fa3}
    monkeypatch.setattr(probe_module, "_installed", lambda name: installed[name])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cuda)


# ------------------------------------------------------------------ probe
@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is not None,
    reason="this machine has CUDA or flash-attn; the check is for a CPU machine without flash-attn",
)
def test_probe_on_this_cpu_machine_gives_both_reasons():
    reasons = probe_module.probe()
    assert len(reasons) == 2, reasons
    assert reasons[0].startswith("flash-attn is not installed") and "pip install flash-attn --no-build-isolation" in reasons[0]
    assert reasons[1].startswith("needs a CUDA device")


def test_probe_reasons_per_machine(monkeypatch):
    fake_machine(monkeypatch, fa2=False, fa3=False, cuda=None)
    assert [r.split(" (")[0] for r in probe_module.probe()] == ["flash-attn is not installed", "needs a CUDA device"]
    fake_machine(monkeypatch, fa2=True, fa3=False, cuda=(7, 5))
    assert probe_module.probe() == ["needs compute capability 8.0 or newer (Ampere+), this GPU is 7.5"]
    fake_machine(monkeypatch, fa2=False, fa3=True, cuda=(8, 6))
    (only,) = probe_module.probe()
    assert "only flash_attn_interface (FA3) is installed" in only and "this GPU is 8.6" in only
    fake_machine(monkeypatch, fa2=False, fa3=True, cuda=(9, 0))
    assert probe_module.probe() == []
    fake_machine(monkeypatch, fa2=True, fa3=False, cuda=(8, 0))
    assert probe_module.probe() == []


# ------------------------------------------------------------ declaration
def test_declared_capabilities_are_flash_attns_limits():
    caps = FLASH_CAPABILITIES
    assert caps.check(spec()) == []
    for ok in (dict(head_size=80), dict(head_size=256), dict(head_size=8), dict(block_size=768), dict(dtype=torch.float16),
               dict(num_kv_heads=1)):
        assert caps.check(spec(**ok)) == [], ok
    assert caps.check(spec(head_size=100)) == [f"head size 100 not in {_fmt(caps.head_sizes)}"]
    assert caps.check(spec(head_size=264))[0].startswith("head size 264 not in")
    assert caps.check(spec(block_size=16))[0].startswith("block size 16 not in {256, 512, 768")
    assert caps.check(spec(dtype=torch.float32)) == ["dtype float32 not in {bfloat16, float16}"]
    assert caps.check(spec(device=torch.device("cpu"))) == ["device cpu not in {cuda}"]
    assert caps.cuda_graph_decode and caps.gqa


def _fmt(values) -> str:
    return "{" + ", ".join(map(str, sorted(values))) + "}"


def test_listing_imports_neither_torch_nor_flash_attn():
    code = (
        "import sys, corerun_attention_flash.plugin\n"
        "bad = [m for m in ('torch', 'flash_attn', 'flash_attn_interface') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_lists_flash_unavailable_and_refuses_an_undeclared_block_size():
    from corerun.sdk import Registry

    registry = Registry.from_environment(allow=["attention_flash"])
    reg = registry.get("attention", "flash")
    assert reg.distribution == "corerun-attention-flash" and reg.capabilities == FLASH_CAPABILITIES
    with pytest.raises(PluginUnavailableError) as info:
        registry.select_attention("flash", spec(block_size=16))
    assert any(r.startswith("block size 16 not in") for r in info.value.reasons)
    if not torch.cuda.is_available():
        assert any(r.startswith("needs a CUDA device") for r in info.value.reasons)


# ------------------------------------------------------------ construction
def test_construction_names_every_reason():
    with pytest.raises(UnsupportedError) as info:
        FlashAttentionBackend(spec(dtype=torch.float32, head_size=100, block_size=16, device=torch.device("cpu")))
    text = str(info.value)
    for part in ("dtype float32 not in", "head size 100 not in", "block size 16 not in", "device cpu not in {cuda}"):
        assert part in text, text
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn is not installed" in text
    assert info.value.implementation == "attention backend 'flash'"


def test_construction_under_emulation_still_refuses_undeclared_specs():
    with emulated():
        with pytest.raises(UnsupportedError, match=r"dtype float32 not in \{bfloat16, float16\}$"):
            FlashAttentionBackend(spec(dtype=torch.float32, device=torch.device("cpu")))


def test_a_library_refusal_at_startup_becomes_unsupported(monkeypatch):
    """The construction self-check turns flash-attn's own refusal into UnsupportedError, before any step."""
    from corerun_attention_flash.testing import flash_attn_emulator

    @functools.wraps(flash_attn_emulator.flash_attn_with_kvcache)  # same signature, as a real build has
    def refuse(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(flash_attn_emulator, "flash_attn_with_kvcache", refuse)
    with emulated():
        with pytest.raises(UnsupportedError, match=r"refused a bfloat16 paged cache of block size 256 .*Ampere GPUs or newer"):
            FlashAttentionBackend(spec(device=torch.device("cpu")))


def test_fa3_too_old_for_a_paged_cache_is_named(monkeypatch):
    from corerun_attention_flash.testing import flash_attn_interface_emulator

    def old_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False):
        raise AssertionError("never called")

    monkeypatch.setattr(flash_attn_interface_emulator, "flash_attn_with_kvcache", old_with_kvcache)
    with emulated("flash_attn_interface"):
        with pytest.raises(UnsupportedError) as info:
            FlashAttentionBackend(spec(device=torch.device("cpu")))
    text = str(info.value)
    assert "flash-attn is not installed" in text
    assert "flash_attn_interface (FA3) lacks flash_attn_with_kvcache(page_table=...)" in text


def test_fa2_too_old_for_a_paged_cache_is_named(monkeypatch):
    from corerun_attention_flash.testing import flash_attn_emulator

    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):
        raise AssertionError("never called")

    monkeypatch.setattr(flash_attn_emulator, "flash_attn_varlen_func", old_varlen)
    with emulated():
        with pytest.raises(UnsupportedError, match=r"is too old: it lacks flash_attn_varlen_func\(block_table=...\); corerun needs flash-attn >= 2.6"):
            FlashAttentionBackend(spec(device=torch.device("cpu")))


def test_kv_cache_layout_is_flash_attns():
    with emulated() as flash:
        backend = flash.create(spec(num_kv_heads=2, head_size=64, device=torch.device("cpu")))
    cache = backend.allocate_kv_cache(3)
    assert cache.shape == (2, 3, 256, 2, 64) and cache.dtype == torch.bfloat16 and not cache.any()
    assert backend.kv_cache_bytes_per_block() * 3 == cache.numel() * cache.element_size()
    k, v = backend.kv_cache_view(cache)
    assert k.shape == v.shape == (3, 256, 2, 64) and k.is_contiguous() and v.is_contiguous()
    k[1, 5] = 1.0
    v[2, 7] = 2.0
    assert cache[0, 1, 5].eq(1).all() and cache[1, 2, 7].eq(2).all() and cache.count_nonzero() == 2 * 2 * 64  # two slots x 2 KV heads x 64


def test_emulation_does_not_leak_into_plain_construction():
    with emulated():
        pass
    with pytest.raises(UnsupportedError, match="device cpu not in"):
        FlashAttentionBackend(dataclasses.replace(spec(), device=torch.device("cpu")))
