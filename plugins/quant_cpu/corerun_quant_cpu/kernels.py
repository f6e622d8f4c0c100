"""Building, loading and calling the C++ kernels (``csrc/gguf_gemv.cpp``), a torch operator library.

Built on first use with ``torch.utils.cpp_extension`` (ninja and a C++ compiler) into corerun's cache
folder (``$CORERUN_CACHE_DIR/quant_cpu/<key>/``, see ``corerun.sdk.cache_dir``); the key hashes the
source, the torch version and the flags, so an edit or another torch builds anew.  The source is
compiled without ``-march``: the AVX2 functions carry their own target attribute and are chosen at
run time from the CPU's feature flags (cpuid): AVX-512 (F, BW, VL, DQ) with VNNI, which quantizes the
activations to int8 and multiplies with integer dot products, else AVX2 + FMA + F16C, else scalar.  ``-fopenmp`` makes
``at::parallel_for`` use torch's thread pool; the library links torch's own ``libgomp`` (from
``torch/lib``), never a second OpenMP runtime.

``CORERUN_QUANT_CPU_ISA=scalar`` (or ``avx2``) forces that path (tests, comparisons).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger("corerun_quant_cpu")

SOURCE = Path(__file__).parent / "csrc" / "gguf_gemv.cpp"
SOURCES = (SOURCE, *(Path(__file__).parent / "csrc" / n for n in ("gguf_k.cpp", "bf16_gemv.cpp", "f32_gemv.cpp", "int8_amx.cpp", "int8_vnni.cpp")))  # one library; the others add their ops
HEADERS = tuple(Path(__file__).parent / "csrc" / n for n in ("amx_tiles.h", "w8a8_quantize.h", "bf16_round.h", "cpu_features.h", "row_streams.h"))  # included by the sources: in the build key too
NAME = "corerun_quant_cpu"
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-std=c++17")
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # ordered: each runs where the ones above it do
TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}  # the 32-value GGML types gguf_gemv reads
K_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # the 256-value ones gguf_k_gemv reads (GGML's numbers)
ISA_ENV = "CORERUN_QUANT_CPU_ISA"

_lock = threading.Lock()
_loaded: list[str] | None = None  # [] once loaded, else the reasons it cannot be


def build_dir() -> Path:
    from corerun.sdk import cache_dir

    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in (*SOURCES, *HEADERS)), torch.__version__.encode(), " ".join(CFLAGS).encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / "quant_cpu" / h.hexdigest()[:20]


def _torch_lib() -> Path:
    return Path(torch.__file__).parent / "lib"


def _build_and_load() -> list[str]:
    target = build_dir()
    built = target / f"{NAME}.so"
    if built.is_file():  # the key covers source, torch and flags: load it without asking ninja (about 0.5 s)
        try:
            torch.ops.load_library(str(built))
            return []
        except (OSError, RuntimeError) as exc:
            logger.warning("quant_cpu: %s does not load (%s); building it again", built, exc)
    if shutil.which("ninja") is None:
        return ["ninja is not on PATH (torch.utils.cpp_extension builds with it): install it (apt-get install ninja-build, "
                "or pip install ninja in an activated environment), or keep quantization: gguf"]
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return [f"no C++ compiler: {cxx!r} is not on PATH; install one (e.g. apt-get install g++) or keep quantization: gguf"]
    ldflags = []
    if (_torch_lib() / "libgomp.so.1").is_file():  # torch's own OpenMP runtime, the one already in the process
        ldflags = [f"-L{_torch_lib()}", "-l:libgomp.so.1", f"-Wl,-rpath,{_torch_lib()}"]
    from torch.utils import cpp_extension

    target.mkdir(parents=True, exist_ok=True)
    try:
        logger.info("quant_cpu: building %s in %s", ", ".join(s.name for s in SOURCES), target)
        cpp_extension.load(
            name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=ldflags,
            build_directory=str(target), is_python_module=False, verbose=False,
        )
    except Exception as exc:  # a compiler error, a missing header: the reason, not a crash
        tail = " ".join(str(exc).strip().splitlines()[-6:])
        return [f"building {', '.join(s.name for s in SOURCES)} with torch.utils.cpp_extension failed: {type(exc).__name__}: {tail}"]
    return []


def load() -> list[str]:
    """``[]`` once the operators are registered, else the reasons they cannot be.  Built at most once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load()
        return _loaded


def best_isa() -> str:
    """The instruction set the kernels use here: ``avx512`` where the CPU has AVX-512 F/BW/VL/DQ and VNNI,
    ``avx2`` where it has AVX2, FMA and F16C, else ``scalar``."""
    best = torch.ops.corerun_quant_cpu.gguf_isa()
    return next(name for name, number in ISAS.items() if number == best)


def runnable_isas() -> list[str]:
    """Every instruction set the kernels can be forced to here, scalar first (tests run each)."""
    return [name for name, number in ISAS.items() if number <= ISAS[best_isa()]]


def chosen_isa() -> str:
    """:func:`best_isa`, or what ``$CORERUN_QUANT_CPU_ISA`` asks for (refused when this CPU lacks it)."""
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if not asked:
        return best_isa()
    if asked not in ISAS:
        raise ValueError(f"${ISA_ENV}={asked!r}: expected one of {sorted(ISAS)}")
    if ISAS[asked] > ISAS[best_isa()]:
        raise ValueError(f"${ISA_ENV}={asked!r}: this CPU runs at most {best_isa()!r}")
    return asked


def gguf_gemv(out: torch.Tensor, blocks: torch.Tensor, x: torch.Tensor, type_name: str, isa: str) -> None:
    """``out[t, j] = sum_i x[t, i] * W[j, i]`` with ``W`` the GGML rows ``blocks``, decoded in registers.

    ``blocks`` uint8 ``[rows, cols / block_size * block_bytes]`` contiguous; ``x`` float32 ``[T, cols]``
    contiguous; ``out`` float32 ``[T, rows]`` whose last dimension is contiguous (a column slice of a
    wider output); ``type_name`` one of :data:`TYPES` (32-value blocks) or :data:`K_TYPES` (256-value
    super-blocks, ``cols`` a multiple of 256: ``csrc/gguf_k.cpp``, whose ``avx2`` multiplies in float32);
    ``isa`` one of :data:`ISAS`.
    """
    if type_name in K_TYPES:
        torch.ops.corerun_quant_cpu.gguf_k_gemv(out, blocks, x, K_TYPES[type_name], ISAS[isa])
    else:
        torch.ops.corerun_quant_cpu.gguf_gemv(out, blocks, x, TYPES[type_name], ISAS[isa])


def gguf_dequantize(out: torch.Tensor, blocks: torch.Tensor, type_name: str, isa: str) -> None:
    """``out`` (float32 ``[rows, cols]``, contiguous) = the GGML rows ``blocks`` decoded, for calls too
    large for :func:`gguf_gemv` (prefill), whose product then goes to torch's matmul.  The K types have
    one (scalar) decoder, whatever ``isa``."""
    if type_name in K_TYPES:
        torch.ops.corerun_quant_cpu.gguf_k_dequantize(out, blocks, K_TYPES[type_name])
    else:
        torch.ops.corerun_quant_cpu.gguf_dequantize(out, blocks, TYPES[type_name], ISAS[isa])


def repack_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows (uint8 ``[rows, nb * 34]``, contiguous) as :func:`gguf_gemv_q8_0_repacked` reads them:
    ``codes`` uint8 ``[rows, nb * 32]`` (each code + 128, in the order the AVX-512 product sums them: see
    ``csrc/gguf_gemv.cpp``) and ``scales`` float16 ``[rows, nb]`` (the blocks' ``d``)."""
    rows, nb = blocks.shape[0], blocks.shape[1] // 34
    codes = torch.empty(rows, nb * 32, dtype=torch.uint8)
    scales = torch.empty(rows, nb, dtype=torch.float16)
    torch.ops.corerun_quant_cpu.gguf_q8_0_repack(codes, scales, blocks)
    return codes, scales


def gguf_gemv_q8_0_repacked(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> None:
    """:func:`gguf_gemv` of Q8_0 rows repacked by :func:`repack_q8_0` (AVX-512 + VNNI only): ``x`` float32
    ``[T, cols]`` contiguous, ``out`` float32 ``[T, rows]`` with a contiguous last dimension."""
    torch.ops.corerun_quant_cpu.gguf_gemv_q8_0r(out, codes, scales, x)


W4_GRANULES = (4, 2, 1)  # blocks of 32 features per scale that w4_gemv reads, the widest first


def repack_w4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """Group-wise 4-bit codes (``corerun.quantization.quantized_tensor.Codes``: ``w[j, i] = scales[j, g] * (q[j, i] -
    zeros[j, g])``, ``g = groups[i]``) as :func:`w4_gemv` reads them: ``(codes, scales, negzs, gb)``.

    ``codes`` uint8 ``[rows, cols / 2]``: per row and 32-block 16 bytes, byte ``i`` holding value ``i`` (low nibble) and
    ``16 + i`` (high), GGML's Q4 order; ``scales`` and ``negzs`` float32 ``[rows, ceil(cols / 32 / gb)]``: per granule
    of ``gb`` blocks (4, 2 or 1, the widest inside one group everywhere) its scale and ``-scale * zero``.
    ``None`` where the kernel cannot take them: ``cols`` not a multiple of 32, codes outside 0..15, or a group
    that is not whole 32-blocks in order (activation order: permute the columns first)."""
    rows, cols = q.shape
    if rows == 0 or cols == 0 or cols % 32 or q.min() < 0 or q.max() > 15:
        return None
    nb = cols // 32
    by_block = groups.reshape(nb, 32)
    if not bool((by_block == by_block[:, :1]).all()) or not bool((groups[1:] >= groups[:-1]).all()):
        return None
    first = by_block[:, 0]  # the group of each block
    gb = next(n for n in W4_GRANULES if all(bool((first[u : u + n] == first[u]).all()) for u in range(0, nb, n)))
    g = first[::gb]
    s = scales[:, g].float()
    halves = q.to(torch.uint8).reshape(rows, nb, 2, 16)
    codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()
    return codes, s.contiguous(), (-(s.double() * zeros[:, g].double())).float().contiguous(), gb


def w4_available() -> bool:
    """Whether :func:`w4_gemv` runs here: AVX-512 F/BW/VL/DQ/VBMI with VNNI (``gguf_gemv``'s ``avx512``), not forced
    off by ``$CORERUN_QUANT_CPU_ISA``."""
    return chosen_isa() == "avx512"


def w4_gemv(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, negzs: torch.Tensor, x: torch.Tensor, gb: int) -> None:
    """``out[t, j] = sum_i x[t, i] * W[j, i]`` with ``W`` :func:`repack_w4`'s (AVX-512 + VNNI only; ``x`` quantized
    to int8 per token and 32-block as the GGUF products do): ``x`` float32 ``[T, cols]`` contiguous, ``out`` float32
    ``[T, rows]`` with a contiguous last dimension."""
    torch.ops.corerun_quant_cpu.w4_gemv(out, codes, scales, negzs, x, gb)


def w4_dequantize(codes: torch.Tensor, scales: torch.Tensor, negzs: torch.Tensor, gb: int, isa: str | None = None) -> torch.Tensor:
    """:func:`repack_w4`'s weights decoded: float32 ``[rows, cols]`` (``s q - s z``; for calls too large for
    :func:`w4_gemv`, whose product then goes to torch's matmul).  ``isa`` (default :func:`chosen_isa`): ``avx512``
    decodes 16 values a vector, the others with a scalar loop."""
    out = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)
    torch.ops.corerun_quant_cpu.w4_dequantize(out, codes, scales, negzs, gb, ISAS[isa or chosen_isa()])
    return out


# bf16_gemv's: AVX-512 F widens to float32, BF16 has vdpbf16ps, AMX multiplies 16 x 32 tiles (columns a multiple of 32)
BF16_ISAS = {"scalar": 0, "avx512": 1, "avx512_bf16": 2, "amx": 3}
BF16_NATIVE = ("avx512_bf16", "amx")  # the ones that multiply bfloat16 natively: where dense_cpu is worth picking


def bf16_best_isa() -> str:
    """The best instruction set :func:`bf16_gemv` runs here: ``amx`` where the CPU has AMX-TILE and AMX-BF16
    and Linux grants the process the tile state, ``avx512_bf16`` where it has AVX512_BF16 (with F, BW, VL),
    ``avx512`` where it has AVX-512 F/BW/VL, else ``scalar``."""
    best = torch.ops.corerun_quant_cpu.bf16_isa()
    return next(name for name, number in BF16_ISAS.items() if number == best)


def repack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[rows, cols]`` as :func:`bf16_gemv` reads it: bfloat16 ``[ceil(rows / 16), ceil(cols / 2) * 32]``,
    16 rows at a time with their columns in pairs (``packed[b, (p * 16 + r) * 2 + c] = weight[16 b + r, 2 p + c]``),
    zeros past the last row and after an odd last column."""
    rows, cols = weight.shape
    packed = torch.empty((rows + 15) // 16, (cols + 1) // 2 * 32, dtype=torch.bfloat16)
    torch.ops.corerun_quant_cpu.bf16_repack(packed, weight.to(torch.bfloat16).contiguous())
    return packed


def bf16_gemv(out: torch.Tensor, packed: torch.Tensor, x: torch.Tensor, isa: str) -> None:
    """``out[t, j] = sum_i x[t, i] * W[j, i]`` in float32, rounded to bfloat16, ``W`` repacked by :func:`repack_bf16`.

    ``x`` bfloat16 ``[T, cols]`` contiguous; ``out`` bfloat16 ``[T, rows]`` with a contiguous last dimension;
    ``isa`` one of :data:`BF16_ISAS`.  Tokens go 8 to a pass over the weights."""
    torch.ops.corerun_quant_cpu.bf16_gemv(out, packed, x, BF16_ISAS[isa])


# f32_gemv's: AVX-512 F multiplies 16 rows a column at a time
F32_ISAS = {"scalar": 0, "avx512": 1}


def f32_best_isa() -> str:
    """The best instruction set :func:`f32_gemv` runs here: ``avx512`` where the CPU has AVX-512 F/BW/VL, else ``scalar``."""
    best = torch.ops.corerun_quant_cpu.f32_isa()
    return next(name for name, number in F32_ISAS.items() if number == best)


def repack_f32(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[rows, cols]`` as :func:`f32_gemv` reads it: float32 ``[ceil(rows / 16), cols * 16]``, 16 rows at a
    time column by column (``packed[b, i * 16 + r] = weight[16 b + r, i]``), zeros past the last row."""
    rows, cols = weight.shape
    packed = torch.empty((rows + 15) // 16, cols * 16, dtype=torch.float32)
    torch.ops.corerun_quant_cpu.f32_repack(packed, weight.to(torch.float32).contiguous())
    return packed


def f32_gemv(out: torch.Tensor, packed: torch.Tensor, x: torch.Tensor, isa: str) -> None:
    """``out[t, j] = sum_i x[t, i] * W[j, i]`` in float32, ``W`` repacked by :func:`repack_f32`.

    ``x`` float32 ``[T, cols]`` contiguous; ``out`` float32 ``[T, rows]`` with a contiguous last dimension;
    ``isa`` one of :data:`F32_ISAS`.  Tokens go 8 to a pass over the weights."""
    torch.ops.corerun_quant_cpu.f32_gemv(out, packed, x, F32_ISAS[isa])


def int8_amx_available() -> bool:
    """Whether :func:`int8_amx_linear` runs here: AMX-TILE and AMX-INT8, and Linux grants the process the tile state."""
    return bool(torch.ops.corerun_quant_cpu.int8_amx_available())


def repack_int8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` int8 ``[rows, cols]`` (``cols`` a multiple of 64) as :func:`int8_amx_linear` reads it: int8
    ``[ceil(rows / 16), cols * 16]``, 16 rows at a time with their columns in fours
    (``packed[b, (q * 16 + r) * 4 + c] = weight[16 b + r, 4 q + c]``: AMX's B-tile layout), zeros past the last row."""
    rows, cols = weight.shape
    packed = torch.empty((rows + 15) // 16, cols * 16, dtype=torch.int8)
    torch.ops.corerun_quant_cpu.int8_repack(packed, weight.contiguous())
    return packed


def int8_amx_linear(out: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, x: torch.Tensor) -> None:
    """W8A8 as :mod:`corerun.quantization.int8_matmul` defines it (activations quantized per token, the
    int32 sums scaled by the weight row's and the token's scale): ``x`` float32 or bfloat16 ``[T, cols]``
    contiguous, ``packed`` :func:`repack_int8`'s, ``weight_scale`` float32 ``[rows]``, ``out`` ``[T, rows]``
    of ``x``'s dtype with a contiguous last dimension."""
    torch.ops.corerun_quant_cpu.int8_amx_linear(out, packed, weight_scale, x)


INT8_MAX_COLS = 65536  # the widest W8A8 layer either kernel takes (int32 sums of 255 x 128 per column; csrc/w8a8_quantize.h)


def int8_vnni_available() -> bool:
    """Whether :func:`int8_vnni_linear` runs here: AVX-512 F/BW/VL/DQ with VNNI."""
    return bool(torch.ops.corerun_quant_cpu.int8_vnni_available())


def int8_corrections(weight: torch.Tensor) -> torch.Tensor:
    """What :func:`int8_vnni_linear` starts each row's sum from: int32 ``[ceil(rows / 16) * 16]``, ``-128`` times
    the row's sum of codes (its unsigned activation codes are ``q + 128``), zeros past the last row."""
    rows = weight.shape[0]
    corr = torch.zeros((rows + 15) // 16 * 16, dtype=torch.int32)
    corr[:rows] = weight.sum(dim=1, dtype=torch.int32).mul_(-128)
    return corr


def int8_vnni_linear(out: torch.Tensor, packed: torch.Tensor, corrections: torch.Tensor, weight_scale: torch.Tensor, x: torch.Tensor) -> None:
    """:func:`int8_amx_linear`'s product on AVX-512 VNNI: the same operands, and :func:`int8_corrections` of the weight."""
    torch.ops.corerun_quant_cpu.int8_vnni_linear(out, packed, corrections, weight_scale, x)


AMX_TUNING = ("large_tokens", "group_bytes", "chunk_tokens", "order")


def amx_tuning(**values: int) -> dict[str, int]:
    """The AMX products' blocking for many tokens (``csrc/amx_tiles.h``, both :func:`bf16_gemv`'s ``amx`` and
    :func:`int8_amx_linear`), process-wide: ``large_tokens`` (from this many tokens, rounded up to 16, on: the
    blocked path; below: the few-token loop), ``group_bytes`` (weight bytes of one row group), ``chunk_tokens``
    (tokens of one chunk), ``order`` (0: every 32 tokens against each pair of row blocks of a group; 1: each pair
    against every 32 tokens).  Sets the ones given and returns all of them as they were before (benchmarks, tests)."""
    unknown = set(values) - set(AMX_TUNING)
    if unknown or any(v < 0 for v in values.values()):
        raise ValueError(f"amx_tuning: expected non-negative {AMX_TUNING}, got {values}")
    before = torch.ops.corerun_quant_cpu.amx_tuning([values.get(name, -1) for name in AMX_TUNING])
    return dict(zip(AMX_TUNING, before))


def reset() -> None:
    """Forget the load result, so the next :func:`load` looks again (tests)."""
    global _loaded
    with _lock:
        _loaded = None
