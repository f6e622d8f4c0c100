"""Perplexity of the default model on a fixed public-domain text, for each weight format, side by side.

The text is the opening of the United States Declaration of Independence (1776, public domain),
about 300 tokens; one prefill per format through corerun's own layers (torch attention), float32
activations, ``exp(mean -log p(token | the tokens before it))``.  Formats:

- ``float32``: the default model's converted float folder (itself decoded from the shipped Q4_1 file:
  the "float" weights are Q4_1's values, rounded to bfloat16);
- ``Q4_1 (gguf)``: the shipped Q4_1 file, its blocks kept packed (``quantization: gguf``);
- ``Q8_0 (gguf)``: the float folder's projections encoded as Q8_0 blocks by the ``gguf`` package's
  quantizer, run through the same ``gguf`` method;
- ``int8 W8A8`` and ``int4 W4A16 g128``: ``corerun quantize`` of the float folder (compressed-tensors);
- ``int8 W8A16`` (the W8A8 folder with ``input_activations`` removed from its config: the same int8
  weights, float activations): to tell weight error from activation error;
- ``int4 W4A16 g32`` and the ``--asymmetric`` (zero point) variants of both group sizes.

``--kernels`` adds Q4_1 through ``gguf_cpu`` and three int4 folders through ``compressed_tensors_cpu`` (corerun-quant-cpu),
whose few-token products quantize the activations to int8 per 32 values; ``--chunk 16`` feeds the text 16 tokens a
step so that those products run (one prefill of the whole text takes the decoded float path).

    .venv/bin/python benchmarks/perplexity.py [--threads 1] [--chunk 16 --kernels]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands "
    "which have connected them with another, and to assume among the powers of the earth, the separate and equal "
    "station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of "
    "mankind requires that they should declare the causes which impel them to the separation. We hold these "
    "truths to be self-evident, that all men are created equal, that they are endowed by their Creator with "
    "certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure "
    "these rights, Governments are instituted among Men, deriving their just powers from the consent of the "
    "governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the "
    "People to alter or to abolish it, and to institute new Government, laying its foundation on such principles "
    "and organizing its powers in such form, as to them shall seem most likely to effect their Safety and "
    "Happiness. Prudence, indeed, will dictate that Governments long established should not be changed for light "
    "and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, "
    "while evils are sufferable, than to right themselves by abolishing the forms to which they are accustomed."
)


def perplexity(model: Any, ids: list[int], chunk: int = 0) -> float:
    import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
    import torch

    from corerun.testing.tiny_models import corerun_logits

    chunks = None if not chunk else [chunk] * (len(ids) // chunk) + ([len(ids) % chunk] if len(ids) % chunk else [])
    logits = corerun_logits(model, ids, block_size=16, chunks=chunks).double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


def q8_0_method() -> Any:
    """The ``gguf`` method reading a float folder with every projection encoded as Q8_0 blocks on the way in."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from corerun.quantization.gguf_method import GGUFMethod
    from corerun.quantization.gguf_tensor import GGUFTensor
    from corerun.quantization.rtn import PROJECTION

    class Q8_0(GGUFMethod):
        def checkpoint_weights(self, weights: Iterable[tuple[str, Any]], quantization_config: Any) -> Iterator[tuple[str, Any]]:
            for name, t in weights:
                if PROJECTION.search(name) is None:
                    yield name, t
                    continue
                blocks = quantize(t.float().numpy(), GGMLQuantizationType.Q8_0)
                yield name, GGUFTensor(name, "Q8_0", torch.from_numpy(np.ascontiguousarray(blocks)), t.shape[1])

    return Q8_0()


def weights_only(int8_dir: Path, out: Path) -> Path:
    """A copy of the W8A8 folder whose config quantizes the weights only (W8A16)."""
    import json
    import shutil

    shutil.copytree(int8_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (out / "config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=0, help="feed the text this many tokens a step (0: one prefill); "
                        "16 takes corerun-quant-cpu's products down their few-token kernels")
    parser.add_argument("--kernels", action="store_true", help="also the int4 formats and Q4_1 through corerun-quant-cpu's "
                        "methods (compressed_tensors_cpu, gguf_cpu), where they run")
    args = parser.parse_args()

    import torch

    from corerun.models.default import default_model_dir, find_default_gguf
    from corerun.models.gguf_convert import gguf_model_dir
    from corerun.models.loader import load_model
    from corerun.quantization.gguf_method import GGUFMethod
    from corerun.quantization.packed_method import CompressedTensorsMethod
    from corerun.quantization.rtn import quantize_folder
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    float_dir = default_model_dir()
    ids = AutoTokenizer.from_pretrained(str(float_dir))(TEXT)["input_ids"]
    tmp = Path(tempfile.mkdtemp(prefix="corerun-ppl-"))
    formats = [
        ("float32", lambda: load_model(float_dir, dtype=torch.float32)),
        ("Q4_1 (gguf)", lambda: load_model(gguf_model_dir(str(find_default_gguf())), dtype=torch.float32, quant=GGUFMethod())),
        ("Q8_0 (gguf)", lambda: load_model(float_dir, dtype=torch.float32, quant=q8_0_method())),
        ("int8 W8A8", lambda: load_model(quantize_folder(float_dir, tmp / "int8", "int8"), dtype=torch.float32, quant=CompressedTensorsMethod())),
        ("int8 W8A16", lambda: load_model(weights_only(tmp / "int8", tmp / "int8-w"), dtype=torch.float32, quant=CompressedTensorsMethod())),
        ("int4 W4A16 g128", lambda: load_model(quantize_folder(float_dir, tmp / "int4", "int4"), dtype=torch.float32, quant=CompressedTensorsMethod())),
        ("int4 W4A16 g32", lambda: load_model(quantize_folder(float_dir, tmp / "g32", "int4", 32), dtype=torch.float32, quant=CompressedTensorsMethod())),
        ("int4 g128 asym", lambda: load_model(quantize_folder(float_dir, tmp / "a128", "int4", 128, True), dtype=torch.float32, quant=CompressedTensorsMethod())),
        ("int4 g32 asym", lambda: load_model(quantize_folder(float_dir, tmp / "a32", "int4", 32, True), dtype=torch.float32, quant=CompressedTensorsMethod())),
    ]
    if args.kernels:
        from corerun.plugin.registry import Registry

        reg = Registry.from_environment()
        for name in ("gguf_cpu", "compressed_tensors_cpu"):
            if name not in reg.registrations["quantization"] or reg.get("quantization", name).unavailable_reasons():
                raise SystemExit(f"--kernels: {name} cannot run here")
        formats += [
            ("Q4_1 (gguf_cpu)", lambda: load_model(gguf_model_dir(str(find_default_gguf())), dtype=torch.float32,
                                                   quant=reg.create("quantization", "gguf_cpu"))),
            ("int4 g128 (ct_cpu)", lambda: load_model(tmp / "int4", dtype=torch.float32, quant=reg.create("quantization", "compressed_tensors_cpu"))),
            ("int4 g32 (ct_cpu)", lambda: load_model(tmp / "g32", dtype=torch.float32, quant=reg.create("quantization", "compressed_tensors_cpu"))),
            ("int4 g32 asym (ct_cpu)", lambda: load_model(tmp / "a32", dtype=torch.float32, quant=reg.create("quantization", "compressed_tensors_cpu"))),
        ]
    print(f"load average before: {os.getloadavg()}; {len(ids)} tokens; threads {args.threads}; chunk {args.chunk or 'all'}")
    base = None
    print(f"{'format':<22} {'perplexity':>10} {'vs float32':>10} {'seconds':>8}")
    for name, load in formats:
        model, _ = load()
        start = time.perf_counter()
        ppl = perplexity(model, ids, args.chunk)
        seconds = time.perf_counter() - start
        base = base or ppl
        print(f"{name:<22} {ppl:>10.4f} {ppl / base:>10.4f} {seconds:>8.2f}")
        del model
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
