"""Hugging Face transformers as the reference an engine test compares corerun's tokens with."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuations of exactly ``max_tokens`` tokens (EOS ignored), float32."""
    from transformers import AutoModelForCausalLM

    from corerun.bench.hf_run import hf_with_dtype

    model = hf_with_dtype(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


def default_model_dir(progress: bool = True) -> Path:
    """The folder of corerun's default model (what ``LLM()`` serves when no model is named), in Hugging
    Face's layout: converted on first use, once per machine, then read from corerun's cache."""
    from corerun.models.default import default_model_dir as converted

    return converted(progress=progress)
