"""Benchmark worker: llama.cpp through ``llama-cpp-python``'s low-level API, with continuous batching.

``Llama.__call__`` runs one sequence at a time, so batched runs go through ``llama_decode`` with a
batch that mixes sequences, as llama.cpp's own server does: every step decodes one token for each
running sequence and fills the rest of ``n_batch`` with prompt chunks of the sequences still
prefilling.  Every sequence has its own KV stream (``kv_unified = false``) of ``max_model_len``
cells, in the run's dtype (F32 or BF16, rather than llama.cpp's default F16, so that all engines keep
K/V alike).  Greedy only: the argmax is taken over each row's logits.  TTFT and TPOT are stamped per
sequence when its tokens are sampled.

The model is the GGUF file in the request, quantized or not (``corerun bench --model FILE.gguf`` hands
llama.cpp the very file corerun runs).  llama.cpp's extra weight buffers, which repack quantized
tensors for AMX or its CPU_REPACK kernels, are off by default: with them on, ``llama_decode`` died of
a segmentation fault on every Q4_1 and Q8_0 file on the AMX machine this was built on
(llama-cpp-python 0.3.36, ``GGML_NATIVE``); the F32 and BF16 files take no repacked path either way.

``options``: ``n_batch`` (tokens per ``llama_decode``, default 512), ``use_extra_bufts`` (default false).
"""

from __future__ import annotations

import time
from typing import Any

import peer_protocol

KV_TYPES = {"float32": ("GGML_TYPE_F32", 0), "bfloat16": ("GGML_TYPE_BF16", 30)}  # ggml.h's enum ggml_type


def _clear_memory(L: Any, ctx: Any) -> None:
    if hasattr(L, "llama_get_memory"):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
    else:  # older bindings
        L.llama_kv_self_clear(ctx)


class Engine:
    def __init__(self, L: Any, req: dict[str, Any]) -> None:
        import numpy as np

        self.L, self.np = L, np
        n_seqs = max(len(req["prompts"]), 1)
        self.n_batch = int(req["options"].get("n_batch", 512))
        per_seq = -(-int(req["max_model_len"]) // 256) * 256
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        if hasattr(mparams, "use_extra_bufts"):  # llama.cpp's repacked weight buffers (AMX, CPU_REPACK): see above
            mparams.use_extra_bufts = bool(req["options"].get("use_extra_bufts", False))
        t0 = time.perf_counter()
        self.model = L.llama_model_load_from_file(req["gguf"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {req['gguf']}")
        cp = L.llama_context_default_params()
        cp.n_seq_max = n_seqs
        cp.n_ctx = per_seq * n_seqs
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch
        cp.n_threads = cp.n_threads_batch = int(req["threads"])
        name, number = KV_TYPES[req["dtype"]]
        cp.type_k = cp.type_v = getattr(L, name, number)  # some bindings lack the BF16 constant
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = False
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seqs} sequences of {per_seq} tokens")
        self.load_s = time.perf_counter() - t0
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.kv_type = name

    def argmax(self, row: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[list[list[int]], list[float], list[float]]:
        """All sequences at once, continuous batching; outputs and per-sequence first / last token times."""
        L, b = self.L, self.batch
        _clear_memory(L, self.ctx)
        n = len(prompts)
        fed = [0] * n  # prompt tokens fed so far
        outs: list[list[int]] = [[] for _ in range(n)]
        first = [0.0] * n
        last = [0.0] * n
        start = time.perf_counter()
        while any(len(o) < m for o, m in zip(outs, output_lens)):
            k = 0
            rows: list[tuple[int, int]] = []  # (batch row, sequence) whose logits are sampled
            for s in range(n):  # decodes first: one token per running sequence
                if fed[s] == len(prompts[s]) and outs[s] and len(outs[s]) < output_lens[s] and k < self.n_batch:
                    self._add(k, outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True)
                    rows.append((k, s))
                    k += 1
            for s in range(n):  # then prompt chunks
                if k >= self.n_batch:
                    break
                if fed[s] < len(prompts[s]):
                    take = min(len(prompts[s]) - fed[s], self.n_batch - k)
                    for j in range(take):
                        done = fed[s] + j == len(prompts[s]) - 1
                        self._add(k, prompts[s][fed[s] + j], fed[s] + j, s, done)
                        if done:
                            rows.append((k, s))
                        k += 1
                    fed[s] += take
            b.n_tokens = k
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (batch of {k} tokens)")
            now = time.perf_counter()
            for row, s in rows:
                outs[s].append(self.argmax(row))
                if len(outs[s]) == 1:
                    first[s] = now
                last[s] = now
        ttft = [f - start for f in first]
        tpot = [(la - f) / (m - 1) for f, la, m in zip(first, last, output_lens) if m >= 2]
        return outs, ttft, tpot

    def _add(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits


def run(req: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp as L

    if req["temperature"] != 0:
        raise SystemExit("the llama.cpp worker is greedy only (temperature 0)")
    if not req["gguf"]:
        raise SystemExit("the llama.cpp worker needs the model as a GGUF file (request key gguf)")
    eng = Engine(L, req)
    if req["warmup_prompt"]:
        eng.generate([req["warmup_prompt"]], [req["warmup_tokens"]])
    t0 = time.perf_counter()
    outs, ttft, tpot = eng.generate(req["prompts"], req["output_lens"])
    elapsed = time.perf_counter() - t0
    peer_protocol.check_lengths("llama.cpp", outs, req["output_lens"])
    return {
        "engine": "llama.cpp", "version": getattr(L, "__version__", "?"), "elapsed_s": elapsed, "load_s": eng.load_s,
        "output_token_ids": outs, "ttft_s": ttft, "tpot_s": tpot, "threads": int(req["threads"]),
        "details": {"gguf": req["gguf"], "kv_cache_type": eng.kv_type, "n_batch": eng.n_batch, "api": "llama_decode, continuous batching",
                    "use_extra_bufts": bool(req["options"].get("use_extra_bufts", False))},
    }


if __name__ == "__main__":
    peer_protocol.main(run)
