"""Hugging Face transformers as the reference an engine test compares corerun's tokens with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def hf_second_token_law(model_dir: Path, prompt: list[int], temperature: float) -> torch.Tensor:
    """The float64 law ``[V]`` of the second token sampled after ``prompt`` at ``temperature`` (transformers):
    ``sum_t0 p(t0) p(t1 | t0)``, one forward per vocabulary entry (a tiny model's)."""
    from transformers import AutoModelForCausalLM

    from corerun.bench.hf_run import hf_with_dtype

    hf = hf_with_dtype(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        q0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = q0.shape[0]
        q1 = torch.softmax(hf(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1] / temperature, -1)
    return (q0[:, None] * q1).sum(0)


def second_token_fit(llm: Any, model_dir: Path, prompt: list[int], temperature: float, n: int) -> Any:
    """``n`` unseeded samples of 3 tokens after ``prompt`` from ``llm`` (a :class:`corerun.LLM`): the
    chi-square fit (:func:`corerun.testing.stats.chi_square_fit`) of their second tokens to
    :func:`hf_second_token_law`."""
    from corerun.testing.stats import chi_square_fit
    from corerun.sampling_params import SamplingParams

    law = hf_second_token_law(model_dir, prompt, temperature)
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    counts = torch.zeros(law.shape[0])
    for o in llm.generate([prompt] * n, params, use_tqdm=False):
        counts[o.outputs[0].token_ids[1]] += 1
    return chi_square_fit(counts, law)


def default_model_dir(progress: bool = True) -> Path:
    """The folder of corerun's default model (what ``LLM()`` serves when no model is named), in Hugging
    Face's layout: converted on first use, once per machine, then read from corerun's cache."""
    from corerun.models.default import default_model_dir as converted

    return converted(progress=progress)
