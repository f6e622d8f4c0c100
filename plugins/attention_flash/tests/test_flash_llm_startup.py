"""``LLM(attention="flash")`` on a machine flash-attn cannot serve fails at startup with every reason."""

import pytest

from corerun import LLM, PluginUnavailableError


def test_llm_with_flash_fails_at_startup_with_every_reason(tmp_path):
    from corerun.testing.tiny_models import make_tiny_model

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: this checks the CPU refusal")
    model_dir = make_tiny_model(tmp_path, arch="llama")
    with pytest.raises(PluginUnavailableError) as err:
        LLM(model=model_dir, attention="flash", device="cpu", dtype="float32")
    text = str(err.value)
    for reason in ("needs a CUDA device", "dtype float32 not in", "block size 16 not in", "device cpu not in"):
        assert reason in text, (reason, text)
