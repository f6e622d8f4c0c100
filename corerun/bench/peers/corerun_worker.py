"""Benchmark worker: corerun itself (``LLM.generate``), in a fresh process of corerun's interpreter.

``options``: ``config_path``, ``sets`` and ``overrides`` exactly as ``corerun bench`` got them; the
request's ``dtype`` and ``threads`` are applied on top (``threads_setting``, where given, instead of
``threads``: ``auto`` stays ``auto``, while ``threads`` is the count the peers and OpenMP get).  The KV
cache's CPU budget is the request's ``kv_cache_gib``, the figure vLLM's worker gets, unless the configuration
sets ``kv_cache.cpu_memory_gb`` or ``kv_cache.num_blocks`` itself.
"""

from __future__ import annotations

from typing import Any

import peer_protocol


def apply_kv_budget(cfg: Any, gib: int | None) -> None:
    """The KV cache's CPU budget to ``gib`` GiB (the peers' figure), unless the configuration sizes the cache
    itself (``kv_cache.cpu_memory_gb`` or ``kv_cache.num_blocks`` set) or there is no figure."""
    if gib and not {"cpu_memory_gb", "num_blocks"} & cfg.kv_cache.model_fields_set:
        cfg.kv_cache.cpu_memory_gb = float(gib)


def run(req: dict[str, Any]) -> dict[str, Any]:
    from corerun._version import __version__  # (corerun before torch: its OpenMP settings, see corerun.platform.host)

    import torch

    from corerun.bench.corerun_run import load_corerun, run_corerun
    from corerun.bench.workload import LengthRange, Workload
    from corerun.config import load_config
    from corerun.models.hub import with_local_model

    opts = req["options"]
    # threads: the setting itself where the request names it ("auto" sizes each step); the count otherwise
    overrides = dict(opts.get("overrides") or {}, dtype=req["dtype"], threads=opts.get("threads_setting", req["threads"]))
    cfg = with_local_model(load_config(opts.get("config_path"), overrides=overrides, sets=list(opts.get("sets") or ())))
    apply_kv_budget(cfg, req.get("kv_cache_gib"))
    lens = [len(p) for p in req["prompts"]]
    workload = Workload(req["prompts"], req["output_lens"], 0, LengthRange(min(lens), max(lens)),
                        LengthRange(min(req["output_lens"]), max(req["output_lens"])))
    llm, meter, load_s = load_corerun(cfg)
    res = run_corerun(llm, workload, meter, load_s, temperature=req["temperature"], warmup=req["warmup_prompt"] is not None)
    return {
        "engine": "corerun",
        "version": __version__,
        "elapsed_s": res.elapsed_s,
        "load_s": load_s,
        "output_token_ids": res.output_token_ids,
        "ttft_s": res.ttft_s,
        "tpot_s": res.tpot_s,
        "threads": torch.get_num_threads(),
        "peak_rss_bytes": res.peak_memory.bytes,
        "details": {"backends": res.details["backends"], "model": res.details["model"],
                    "kv_cache_cpu_memory_gb": cfg.kv_cache.cpu_memory_gb, "preemptions": getattr(getattr(llm.engine, "scheduler", None), "num_preemptions", None)},
    }


if __name__ == "__main__":
    peer_protocol.main(run)
