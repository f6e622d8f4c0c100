"""Benchmark worker: Hugging Face transformers' ``generate``, in a fresh process of corerun's interpreter.

``options``: ``batching`` ("batched": left-padded batches of ``batch_size`` requests, as vLLM's
``benchmark_throughput --backend hf``; "per-prompt": one ``generate`` per request) and ``batch_size``.
With one request per ``generate`` a streamer stamps each new token, so TTFT and TPOT are measured
per request; batched runs report throughput only.
"""

from __future__ import annotations

import time
from typing import Any

import peer_protocol


class _Stamps:
    """A ``generate`` streamer that records when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run(req: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(req["threads"])
    dtype = getattr(torch, req["dtype"])
    opts = req["options"]
    batch_size = 1 if opts.get("batching") == "per-prompt" else (opts.get("batch_size") or len(req["prompts"]))
    if batch_size > 1:
        return _batched(req, dtype, opts.get("batching", "batched"), batch_size)
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) or 0

    def generate(prompt: list[int], n: int, streamer: Any = None) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad, use_cache=True, streamer=streamer)
        return out[0, len(prompt):].tolist()

    if req["warmup_prompt"]:
        generate(req["warmup_prompt"], req["warmup_tokens"])
    outputs, ttft, tpot = [], [], []
    t0 = time.perf_counter()
    for prompt, n in zip(req["prompts"], req["output_lens"]):
        stamps = _Stamps()
        start = time.perf_counter()
        outputs.append(generate(prompt, n, stamps))
        ttft.append(stamps.times[0] - start)
        if n >= 2:
            tpot.append((stamps.times[-1] - stamps.times[0]) / (n - 1))
    elapsed = time.perf_counter() - t0
    peer_protocol.check_lengths("transformers", outputs, req["output_lens"])
    return {
        "engine": "hf", "version": transformers.__version__, "elapsed_s": elapsed, "load_s": load_s,
        "output_token_ids": outputs, "ttft_s": ttft, "tpot_s": tpot, "threads": torch.get_num_threads(),
        "details": {"batching": "per-prompt", "batch_size": 1, "attn_implementation": str(model.config._attn_implementation)},
    }


def _batched(req: dict[str, Any], dtype: Any, batching: str, batch_size: int) -> dict[str, Any]:
    import torch
    import transformers

    from corerun.bench.hf_run import run_hf
    from corerun.bench.workload import LengthRange, Workload

    lens = [len(p) for p in req["prompts"]]
    workload = Workload(req["prompts"], req["output_lens"], 0, LengthRange(min(lens), max(lens)),
                        LengthRange(min(req["output_lens"]), max(req["output_lens"])))
    res = run_hf(req["model_dir"], workload, dtype=dtype, device=torch.device("cpu"), batching=batching,
                 batch_size=batch_size, temperature=req["temperature"], warmup=req["warmup_prompt"] is not None)
    return {
        "engine": "hf", "version": transformers.__version__, "elapsed_s": res.elapsed_s, "load_s": res.load_s,
        "output_token_ids": res.output_token_ids, "ttft_s": [], "tpot_s": [], "threads": torch.get_num_threads(),
        "peak_rss_bytes": res.peak_memory.bytes, "details": res.details,
    }


if __name__ == "__main__":
    peer_protocol.main(run)
