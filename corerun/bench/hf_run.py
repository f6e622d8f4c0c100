"""Run the same workload through Hugging Face transformers' ``generate`` (the comparison baseline).

Same model folder, dtype and device as the corerun run; every request gets exactly its output length
(``min_new_tokens = max_new_tokens``, so EOS cannot end it early).  Two ways to batch:

- ``batched`` (default, as vLLM's ``benchmark_throughput --backend hf``): requests in workload order,
  ``batch_size`` at a time, left-padded, each batch generating as many tokens as its longest request
  asks for.  Output tokens/s counts the tokens the workload asked for; the extra tokens shorter
  requests compute are the cost of static batching, reported as ``generated_tokens``.
- ``per-prompt``: one ``generate`` per request, no padding and no extra tokens, but no batching.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from corerun.bench.memory import PeakMemoryMeter
from corerun.bench.result import RunResult
from corerun.bench.workload import Workload, warmup_prompt
from corerun.errors import CorerunError

BATCHING = ("batched", "per-prompt")
WARMUP_TOKENS = 8


def hf_with_dtype(load: Callable[..., Any], *args: Any, dtype: torch.dtype, **kwargs: Any) -> Any:
    """``load(*args, dtype=dtype, **kwargs)`` (a transformers ``from_pretrained`` / ``from_config``).

    transformers before 4.56 names the keyword ``torch_dtype`` and hands an unknown ``dtype`` on to the
    model's constructor, which raises ``TypeError``; then the call is made again with ``torch_dtype``.
    """
    try:
        return load(*args, dtype=dtype, **kwargs)
    except TypeError as exc:
        if "dtype" not in str(exc):
            raise
        return load(*args, torch_dtype=dtype, **kwargs)


def run_hf(
    model_dir: str | Path,
    workload: Workload,
    *,
    dtype: torch.dtype,
    device: torch.device,
    batching: str = "batched",
    batch_size: int | None = None,
    temperature: float = 0.0,
    warmup: bool = True,
) -> RunResult:
    """Load ``model_dir`` with transformers and time ``generate`` over the workload."""
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"the HF batch size must be >= 1, got {batch_size}")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CorerunError("--compare hf needs transformers: pip install transformers") from None

    meter = PeakMemoryMeter(device)
    meter.start()
    t0 = time.perf_counter()
    model = hf_with_dtype(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    pad = _pad_token_id(model)
    size = 1 if batching == "per-prompt" else (batch_size or workload.num_seqs)
    if warmup:
        _generate(model, [warmup_prompt(workload, vocab)], WARMUP_TOKENS, pad, temperature, device)
    batches = [list(range(i, min(i + size, workload.num_seqs))) for i in range(0, workload.num_seqs, size)]
    outputs: list[list[int]] = [[] for _ in range(workload.num_seqs)]
    generated = 0
    _sync(device)
    t0 = time.perf_counter()
    for idx in batches:
        new = max(workload.output_lens[i] for i in idx)
        rows = _generate(model, [workload.prompts[i] for i in idx], new, pad, temperature, device)
        generated += new * len(idx)
        for i, row in zip(idx, rows):
            outputs[i] = row[: workload.output_lens[i]]
    _sync(device)
    elapsed = time.perf_counter() - t0
    short = [i for i, (o, n) in enumerate(zip(outputs, workload.output_lens)) if len(o) != n]
    if short:
        raise CorerunError(f"transformers generated fewer tokens than asked for request(s) {short[:5]}")
    peak = meter.read()
    attn = str(getattr(model.config, "_attn_implementation", None) or "default")
    del model
    return RunResult(
        engine="hf",
        elapsed_s=elapsed,
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=workload.num_output_tokens,
        peak_memory=peak,
        load_s=load_s,
        details={"batching": batching, "batch_size": size, "generated_tokens": generated, "attn_implementation": attn},
        output_token_ids=outputs,
    )


def _generate(model: Any, prompts: list[list[int]], new_tokens: int, pad: int, temperature: float, device: torch.device) -> list[list[int]]:
    """Left-pad ``prompts`` into one batch and generate exactly ``new_tokens`` for each; returns the new ids."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    sample = temperature > 0
    gen = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=sample, pad_token_id=pad,
        eos_token_id=model.generation_config.eos_token_id, use_cache=True,
        **({"temperature": temperature, "top_k": None, "top_p": 1.0} if sample else {}),
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
    return out[:, width:].tolist()


def _pad_token_id(model: Any) -> int:
    for cfg in (model.generation_config, model.config):
        for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            v = getattr(cfg, key, None)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if v is not None:
                return int(v)
    return 0  # padded positions are masked out: any id in the vocabulary does


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
