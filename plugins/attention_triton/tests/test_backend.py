"""The factory's refusals, the plugin's registration and probe, and the interpreter switch on CPU."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from triton_attn_cases import make_spec

from corerun import PluginError, UnsupportedError
from corerun.sdk import Registry

from corerun_attention_triton import _mode, probe
from corerun_attention_triton.backend import TritonAttentionBackend, mode_reasons


def test_unsupported_spec_lists_every_reason():
    spec = make_spec(num_heads=6, num_kv_heads=4, head_size=320, dtype=torch.float64, block_size=8)
    with pytest.raises(UnsupportedError) as info:
        TritonAttentionBackend(spec)
    reasons = info.value.reasons
    assert any("dtype float64" in r for r in reasons)
    assert any("head size 320 above the maximum 256" in r for r in reasons)
    assert any("block size 8 not in {16, 32, 64, 128}" in r for r in reasons)
    assert any("num_heads 6 is not a multiple of num_kv_heads 4" in r for r in reasons)
    assert len(reasons) == 4
    assert "triton" in str(info.value)


def test_device_outside_this_process_mode_is_refused():
    # This process interprets (conftest sets TRITON_INTERPRET=1): cuda needs compiled kernels.
    assert mode_reasons("cpu") == []
    [reason] = mode_reasons("cuda")
    assert "device cuda needs compiled Triton kernels" in reason and "TRITON_INTERPRET" in reason
    spec = make_spec()
    with pytest.raises(UnsupportedError, match="device cuda needs compiled Triton kernels"):
        TritonAttentionBackend(dataclasses.replace(spec, device=torch.device("cuda")))


@pytest.mark.parametrize("bad", [0, 65, "4", 2.0, True])
def test_bad_num_splits_is_named(bad):
    with pytest.raises(ValueError, match=r"num_splits must be 'auto' or an integer in 1\.\.64, got"):
        TritonAttentionBackend(make_spec(), num_splits=bad)


def test_probe_reports_interpreter_mode():
    assert probe.probe() == []
    assert probe.mode() == "interpreter (TRITON_INTERPRET=1) on CPU"
    assert TritonAttentionBackend(make_spec()).mode == _mode.INTERPRETED


def test_registered_through_the_entry_point_with_options():
    reg = Registry.from_environment(allow=["attention_triton"]).get("attention", "triton")
    assert reg.distribution == "corerun-attention-triton" and reg.available
    assert reg.capabilities.to_dict()["max_head_size"] == 256
    backend = reg.create(make_spec(), options={"num_splits": 4})
    assert isinstance(backend, TritonAttentionBackend) and backend.forced_splits == 4
    with pytest.raises(PluginError, match="num_splits"):
        reg.create(make_spec(), options={"num_splits": 0})
    with pytest.raises(PluginError, match="split_kv"):
        reg.create(make_spec(), options={"split_kv": True})


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter with no CUDA device and TRITON_INTERPRET unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_cpu_without_triton_interpret_switches_to_the_interpreter():
    """With no CUDA and TRITON_INTERPRET unset, importing the backend sets it before any kernel exists."""
    code = (
        "import os, torch\n"
        "assert not torch.cuda.is_available()\n"
        "from corerun_attention_triton.probe import mode\n"
        "print(mode())\n"
        "import corerun_attention_triton.backend as b, triton\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "print(os.environ['TRITON_INTERPRET'], triton.knobs.runtime.interpret,\n"
        "      isinstance(b.unified_attention.__globals__['unified_attention_kernel'], InterpretedFunction))\n"
    )
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["interpreter (TRITON_INTERPRET=1) on CPU", "1 True True"]


def test_triton_imported_in_compiled_mode_first_is_an_unavailability_reason():
    """Triton's own jit helpers take their mode when triton is first imported: if something imported it
    before the interpreter was asked for, the probe says so instead of the kernels failing mid-step."""
    code = (
        "import triton\n"  # what `import transformers` does first in a user's script
        "from corerun_attention_triton.probe import probe\n"
        "print(probe())\n"
    )
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    assert "imported in compiled mode" in done.stdout and "TRITON_INTERPRET=1" in done.stdout
    fine = _fresh_python(code.replace("import triton\n", ""))
    assert fine.returncode == 0 and fine.stdout.strip() == "[]", fine.stdout + fine.stderr
