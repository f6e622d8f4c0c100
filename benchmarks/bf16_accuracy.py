"""How close corerun's and transformers' bfloat16 logits are to a float64 run of the same weights.

The default model's weights (stored in bfloat16, so every dtype runs the very same values) are run
by transformers in float64; its greedy continuation of each prompt is the token path every engine is
then teacher-forced on.  At each of the ``--steps`` positions the script compares each engine's
bfloat16 logits with the float64 ones: the normwise relative error of the row
(``max |got - ref| / max |ref|``; max and mean over all steps) and whether the top token agrees.
corerun runs the prompt as one prefill, then one decode step per token (the engine's own paths:
paged KV cache, the torch attention backend, CPU linears); transformers runs the whole sequence in
one forward.  For the first ``--layer-prompts`` prompts it adds each decoder layer's output hidden
state against float64 (Frobenius relative error over the prompt's prefill), to find where an
engine loses accuracy.

    .venv/bin/python benchmarks/bf16_accuracy.py --steps 32 --random 8

About 10 minutes on this project's 2 shared cores at load average 8 (4 of them the float64 batch;
``--steps 8 --random 0`` is a quicker look).  ``--model DIR`` measures another model folder.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch

from dtype_greedy_check import TEXTS  # the same chat prompts as the greedy check (this folder is on sys.path)


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row: ``max |got - ref| / max |ref|`` in float64."""
    g, r = got.double(), ref.double()
    return (g - r).abs().amax(dim=-1) / r.abs().amax(dim=-1)


def frob_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    return ((g - r).norm() / r.norm()).item()


def corerun_layers(model: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """Each decoder layer's output ``[T, hidden]`` for one prefill of ``ids`` (a hook per layer)."""
    from corerun.testing.tiny_models import corerun_logits

    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
             for layer in model.model.layers]
    try:
        corerun_logits(model, ids, block_size=16)
    finally:
        for h in hooks:
            h.remove()
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--random", type=int, default=8, help="random-token prompts besides the 8 texts")
    ap.add_argument("--layer-prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None, help="model folder [the built-in default model]")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from corerun.bench.hf_run import hf_with_dtype
    from corerun.models import load_model
    from corerun.models.default import default_model_dir
    from corerun.testing.tiny_models import corerun_logits

    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    model_dir = args.model or str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for text in TEXTS:
        p = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(p["input_ids"]) if hasattr(p, "keys") else list(p))
    rng = random.Random(0)
    top = min(10_000, len(tok))
    prompts += [[rng.randrange(top) for _ in range(rng.randint(16, 64))] for _ in range(args.random)]
    n = args.steps
    print(f"model {model_dir}; {len(prompts)} prompts, {n} teacher-forced steps each; torch {torch.__version__}; "
          f"threads {torch.get_num_threads()}; load {load0:.2f}")

    def hf(dtype: torch.dtype) -> torch.nn.Module:
        return hf_with_dtype(AutoModelForCausalLM.from_pretrained, model_dir, dtype=dtype).eval()

    # float64 truth: the greedy path of all prompts in one left-padded batch (its per-step logits are
    # the teacher-forced ones), then the hidden states of the first prompts' prefills
    ref64 = hf(torch.float64)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = ref64.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        steps = torch.stack(out.logits, dim=1)  # [prompts, n, vocab]
        seqs = [p + out.sequences[i, width : width + n - 1].tolist() for i, p in enumerate(prompts)]
        ref_logits = list(steps.unbind(0))
        ref_hidden = []
        for p in prompts[: args.layer_prompts]:  # hidden_states[k + 1]: layer k's output (the last after the final norm)
            states = ref64(torch.tensor([p]), output_hidden_states=True).hidden_states[1:]
            ref_hidden.append([h[0] for h in states])
    del ref64
    print(f"float64 reference: {time.perf_counter() - t0:.0f} s")

    got: dict[str, list[torch.Tensor]] = {"transformers": [], "corerun": []}
    hidden: dict[str, list[list[torch.Tensor]]] = {"transformers": [], "corerun": []}
    hf16 = hf(torch.bfloat16)
    print(f"transformers attention: {getattr(hf16.config, '_attn_implementation', None)}")
    with torch.inference_mode():
        for i, (p, seq) in enumerate(zip(prompts, seqs)):
            out = hf16(torch.tensor([seq]), output_hidden_states=i < args.layer_prompts)
            got["transformers"].append(out.logits[0, len(p) - 1 :].float())
            if i < args.layer_prompts:
                hidden["transformers"].append([h[0, : len(p)] for h in out.hidden_states[1:]])
    del hf16
    model, _ = load_model(model_dir, dtype="bfloat16", device="cpu")
    for i, (p, seq) in enumerate(zip(prompts, seqs)):
        logits = corerun_logits(model, seq, block_size=16, chunks=[len(p)] + [1] * (n - 1))
        got["corerun"].append(logits[len(p) - 1 :])
        if i < args.layer_prompts:
            layers = corerun_layers(model, p)
            hidden["corerun"].append(layers[:-1] + [model.model.norm(layers[-1])])  # HF's last one is normed
    print(f"all runs: {time.perf_counter() - t0:.0f} s")

    print("\nbfloat16 logits against float64, per step (normwise relative error of the row)")
    print(f"{'engine':<14}{'max rel err':>12}{'mean rel err':>14}{'top-1 agree':>14}{'prompts all-agree':>19}")
    for name, rows in got.items():
        errs = torch.cat([row_errors(g, r) for g, r in zip(rows, ref_logits)])
        agree = [(g.argmax(-1) == r.argmax(-1)) for g, r in zip(rows, ref_logits)]
        hits = torch.cat(agree)
        full = sum(bool(a.all()) for a in agree)
        print(f"{name:<14}{errs.max().item():>12.4f}{errs.mean().item():>14.4f}"
              f"{f'{int(hits.sum())}/{hits.numel()}':>14}{f'{full}/{len(agree)}':>19}")
    both = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(got["corerun"], got["transformers"])])
    print(f"corerun and transformers bfloat16 pick the same top-1 at {int(both.sum())}/{both.numel()} steps")

    for i in range(len(ref_hidden)):
        print(f"\nprompt {i} ({len(prompts[i])} tokens): each layer's output against float64 (Frobenius relative error)")
        print(f"{'layer':>6}{'transformers':>14}{'corerun':>10}")
        for k, ref in enumerate(ref_hidden[i]):
            hf_e = frob_err(hidden["transformers"][i][k], ref)
            cr_e = frob_err(hidden["corerun"][i][k], ref)
            print(f"{k:>6}{hf_e:>14.5f}{cr_e:>10.5f}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
