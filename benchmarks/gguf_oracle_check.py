"""llama.cpp as the oracle for GGUF: corerun's greedy tokens and logits against llama.cpp's on the same file.

The 16 prompts of ``kv_quant_check.py``, tokenized once (the same ids go to both engines), 32 greedy tokens each
(EOS ignored).  llama.cpp (llama-cpp-python in its own virtual environment, ``benchmarks/peers/setup.sh``; its
repacked weight buffers off, as ``corerun bench --compare llama.cpp`` runs it) generates first; then each prompt
followed by llama.cpp's 32 tokens is run through both engines in one pass, and the logits that predicted those 32
tokens are compared (teacher-forced: free of the snowball after a first difference):

- identical: prompts whose 32 greedy tokens equal llama.cpp's (and where the others part);
- top-1: the share of llama.cpp's tokens that corerun's logits also rank first;
- logits: ``max |corerun - llama.cpp|`` over a row, relative to that row's spread (its standard deviation), the
  median and worst over all rows; the median normwise difference of a row; and the mean KL divergence of the
  softmaxes, llama.cpp's the reference.

corerun runs the file through a quantization method (``--methods``, default ``gguf_cpu,gguf``: the C++ products with
int8 activations per 32 values, as llama.cpp's CPU path quantizes them, and the built-in's exact float decode),
float32 activations, one thread, the torch attention for the teacher-forced pass.

    .venv/bin/python benchmarks/gguf_oracle_check.py [--gguf FILE] [--methods gguf_cpu,gguf] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = ROOT / "benchmarks" / "peers" / ".venvs" / "llama.cpp" / "bin" / "python"


def llama_worker(req_path: str) -> None:
    """In llama.cpp's environment: greedy outputs, then every row's logits of prompt + outputs, saved as .npy files."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "corerun" / "bench" / "peers"))
    import llama_cpp as L
    from llamacpp_worker import Engine, _clear_memory

    req = json.loads(Path(req_path).read_text())
    eng = Engine(L, {"prompts": [[0]], "options": {}, "max_model_len": 256, "gguf": req["gguf"], "threads": 1, "dtype": "float32"})
    outs = []
    for ids in req["prompts"]:  # one at a time: each alone in the cache, as corerun's greedy run sees it
        o, _, _ = eng.generate([ids], [req["tokens"]])
        outs.append(o[0])
    for i, (ids, out) in enumerate(zip(req["prompts"], outs)):
        seq = ids + out
        _clear_memory(L, eng.ctx)
        for k, tok in enumerate(seq):
            eng._add(k, tok, k, 0, True)
        eng.batch.n_tokens = len(seq)
        if L.llama_decode(eng.ctx, eng.batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(eng.ctx, k), shape=(eng.n_vocab,)).copy()
                for k in range(len(ids) - 1, len(seq) - 1)]
        np.save(Path(req["out"]) / f"logits{i}.npy", np.stack(rows).astype(np.float32))
    Path(req["out"], "outs.json").write_text(json.dumps(outs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: the default model's shipped Q4_1)")
    ap.add_argument("--methods", default="gguf_cpu,gguf")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help="the first N prompts only")
    ap.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker(args.llama_worker)

    import corerun  # noqa: F401  (before torch: its OpenMP settings)
    import numpy as np
    import torch

    from corerun.llm import LLM
    from corerun.models.default import find_default_gguf
    from corerun.models.gguf_convert import gguf_model_dir
    from corerun.models.loader import load_model
    from corerun.plugin.registry import Registry
    from corerun.sampling_params import SamplingParams
    from corerun.testing.tiny_models import corerun_logits
    from kv_quant_check import PROMPTS  # (this folder is the script's sys.path[0])
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    gguf = str(Path(args.gguf or find_default_gguf()).resolve())
    folder = gguf_model_dir(gguf)
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tok(p)["input_ids"] for p in PROMPTS[: args.prompts]]
    print(f"{Path(gguf).name}: {len(prompts)} prompts x {args.tokens} greedy tokens; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="corerun-oracle-") as tmp:
        req = Path(tmp) / "req.json"
        req.write_text(json.dumps({"gguf": gguf, "prompts": prompts, "tokens": args.tokens, "out": tmp}))
        subprocess.run([str(LLAMA_PYTHON), __file__, "--llama-worker", str(req)], check=True, stderr=subprocess.DEVNULL)  # (its loader log)
        ref_outs = json.loads((Path(tmp) / "outs.json").read_text())
        ref_logits = [torch.from_numpy(np.load(Path(tmp) / f"logits{i}.npy")).double() for i in range(len(prompts))]
    reg = Registry.from_environment()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for name in args.methods.split(","):
        llm = LLM(model=gguf, quantization=name, dtype="float32", threads=1)
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        same = sum(o == r for o, r in zip(outs, ref_outs))
        parts = sorted(next(i for i, (a, b) in enumerate(zip(o, r)) if a != b) for o, r in zip(outs, ref_outs) if o != r)
        model, _ = load_model(folder, dtype=torch.float32, quant=reg.create("quantization", name))
        firsts = total = 0
        spreads, kls, norms = [], [], []
        for ids, out, ref in zip(prompts, ref_outs, ref_logits):
            with torch.no_grad():
                got = corerun_logits(model, ids + out, block_size=16)[len(ids) - 1 : len(ids) + len(out) - 1].double()
            firsts += int((got.argmax(-1) == torch.tensor(out)).sum())
            total += len(out)
            spreads.append(((got - ref).abs().amax(-1) / ref.std(-1)))
            norms.append((got - ref).norm(dim=-1) / ref.norm(dim=-1))
            p = torch.log_softmax(ref, -1)
            kls.append((p.exp() * (p - torch.log_softmax(got, -1))).sum(-1))
        spread, kl, norm = torch.cat(spreads), torch.cat(kls), torch.cat(norms)
        print(f"{name:>9}: {same}/{len(prompts)} prompts identical (the others part at output token {parts}); teacher-forced top-1 "
              f"{firsts / total:.1%}; max |dlogit| / std: median {spread.median():.4f}, worst {spread.max():.4f}; "
              f"||dlogits|| / ||logits|| median {norm.median():.2e}; mean KL {kl.mean():.2e}; load average {os.getloadavg()[0]:.1f}", flush=True)
        del model


if __name__ == "__main__":
    main()
