"""Models with sliding-window layers run past the window: greedy tokens through the engine equal
transformers' (whose masks keep each layer's window) on prompts and generations longer than it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from corerun import SamplingParams
from corerun.errors import UnsupportedError
from corerun.models.config import ModelConfig
from corerun.models.errors import ModelLoadError
from corerun.models.llama import MistralForCausalLM
from corerun.models.qwen2 import Qwen2ForCausalLM
from corerun.testing.engines import make_llm
from corerun.testing.tiny_models import hf_model, make_tiny_model, tiny_config

WINDOW = 16


def _hf_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = hf_model(folder)
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(ids):])
    return out


def _attention_backend() -> str:
    from corerun.plugin.registry import get_registry

    try:
        return "cpu" if get_registry().get("attention", "cpu").available else "torch"
    except (KeyError, UnsupportedError):
        return "torch"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("arch", "keys"),
    [("mistral", {"sliding_window": WINDOW}),  # every layer slides
     ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1})],  # layer 1 slides
)
def test_greedy_past_the_window_equals_transformers(tmp_path: Path, arch: str, keys: dict) -> None:
    folder = make_tiny_model(tmp_path, arch, **keys)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 256, (12,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 256, (11,), generator=gen).tolist(),  # 23 tokens: past the window
               shared + torch.randint(3, 256, (2,), generator=gen).tolist()]  # 14: crosses it while decoding
    want = _hf_greedy(folder, prompts, 12)
    # chunks of 8 tokens, prefix caching on (the second prompt hits the first's blocks), two at a time
    with make_llm(folder, attention=_attention_backend(), scheduler={"max_num_batched_tokens": 8, "max_num_seqs": 2}) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def _config(arch: str, **keys) -> ModelConfig:
    return ModelConfig.from_dict({**tiny_config(arch, **keys).to_dict(), "architectures": [f"{arch}"]})


def test_layer_windows_per_family() -> None:
    mistral = _config("mistral", sliding_window=WINDOW, num_hidden_layers=3)
    assert MistralForCausalLM.layer_windows(mistral) == (WINDOW,) * 3
    assert mistral.max_model_len == mistral.max_position_embeddings  # no longer capped at the window
    qwen = _config("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, num_hidden_layers=4)
    assert Qwen2ForCausalLM.layer_windows(qwen) == (None, None, WINDOW, WINDOW)
    raw = {k: v for k, v in qwen.raw.items() if k != "layer_types"}  # a transformers-4 config.json: the rule applies
    assert Qwen2ForCausalLM.layer_windows(ModelConfig.from_dict(raw)) == (None, None, WINDOW, WINDOW)
    off = _config("qwen2", use_sliding_window=False, sliding_window=WINDOW)
    assert Qwen2ForCausalLM.layer_windows(off) == (None, None)


def test_bad_layer_types_named() -> None:
    raw = {**tiny_config("mistral").to_dict(), "layer_types": ["full_attention", "local"]}
    with pytest.raises(ModelLoadError, match="layer_types must list one of full_attention, sliding_attention for each of the 2"):
        ModelConfig.from_dict(raw)
