"""CUDA's products of group-wise integer weights (W4A16, W8A16): one Triton GEMM launch per layer.

The weights are what :class:`~corerun.quantization.quantized_tensor.Codes` gives, packed once at load by
:func:`pack`: ``w[n, k] = s[n, g] * q[n, k] + c[n, g]`` with ``c = -s * z`` and ``g = k // group`` (a shard in
activation order has its columns sorted by group first; :func:`pack` returns the permutation, and the
activations are permuted to match).  ``q`` are unsigned 4- or 8-bit codes, ``32 / bits`` to an int32 word along
the input features (``words[n, k // per] >> (bits * (k % per))``); ``s`` and ``c`` float32 ``[N, G]``.  This takes
GPTQ (4- and 8-bit) and AWQ (4-bit), zero points included, compressed-tensors ``pack-quantized`` and ``int-quantized`` W8A16
(the int8 codes offset by 128, zero point 128, one group the whole row).

:func:`int_gemm_kernel`: program ``(m, n)`` multiplies ``BLOCK_M`` rows of ``x`` by ``BLOCK_N`` output
features: for each ``BLOCK_K`` slice of the input features the words are loaded (each word once per element
it holds: the loads coalesce), the codes shifted out and decoded in registers with their group's ``s`` and
``c`` into ``x``'s dtype, and ``tl.dot`` accumulates in float32; nothing decoded is written to memory.
Inputs float16, bfloat16 or float32 (float32: ``UPCAST``, products without TF32).  Off CUDA (tests) the kernel
runs in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before this module was imported (there a
half-precision product is done in float32 on the weights rounded to ``x``'s dtype, ``EMULATE``: the interpreter's
``tl.dot`` of a tensor converted to bfloat16 in the kernel gives garbage, and its conversion truncates);
``scripts/compile_check.py --kernels int_gemm`` compiles it for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from corerun.quantization.quantized_tensor import Codes

BLOCK_M = 16  # decode steps and small batches; a prefill's M tiles the same way
BLOCK_N = 64
BLOCK_K = 32
BLOCK_N_FP32 = 32  # float32 products without TF32 hold twice the registers
NUM_WARPS = 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class PackedInt:
    """One layer's (or merged shards') weights as :func:`int_gemm` reads them; ``perm``: the column order
    (``None``: natural)."""

    words: torch.Tensor  # int32 [N, ceil(K / per)]
    scales: torch.Tensor  # float32 [N, G]
    negzs: torch.Tensor  # float32 [N, G]
    bits: int
    group: int
    in_features: int
    perm: torch.Tensor | None


def pack(codes: Codes, bits: int) -> PackedInt | None:
    """``codes`` packed for :func:`int_gemm`; ``None`` where the groups are not runs of equal length after sorting
    (a kernel reads ``g = k // group``).  The groups may start past 0 (a row-parallel rank's slice of GPTQ's ``g_idx``,
    which keeps the whole model's group numbers): only the groups used are kept."""
    rows, cols = codes.q.shape
    if rows == 0 or cols == 0:
        return None
    codes, perm = codes.in_group_order()
    q, groups = codes.q, codes.groups
    g0 = int(groups[0])
    group = int((groups == g0).sum())
    if not torch.equal(groups, torch.arange(cols, device=groups.device) // group + g0):
        return None
    per = 32 // bits
    q = torch.nn.functional.pad(q.to(torch.int32), (0, -cols % per))
    words = torch.zeros(rows, q.shape[1] // per, dtype=torch.int32, device=q.device)
    for i in range(per):  # in int32 (a shift into the sign bit wraps): no int64 copy of the weight
        words |= q[:, i::per] << (bits * i)
    used = int(groups[-1]) - g0 + 1
    s = codes.scales[:, g0 : g0 + used].float()
    negz = (-(s.double() * codes.zeros[:, g0 : g0 + used].double())).float()
    return PackedInt(words, s.contiguous(), negz.contiguous(), bits, group, cols, perm)


@triton.jit
def int_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    c_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_wn,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[m, n] = sum_k x[m, k] * (s[n, k // GROUP] * q[n, k] + c[n, k // GROUP])``.

    - ``x_ptr`` ``[M, K]`` (row stride ``stride_xm``, columns contiguous), the activations;
    - ``w_ptr`` int32 ``[N, ceil(K / (32 / BITS))]`` (row stride ``stride_wn``), the packed codes;
    - ``s_ptr`` / ``c_ptr`` float32 ``[N, G]`` contiguous: each group's scale and ``-scale * zero``;
    - ``out_ptr`` ``[M, N]`` (row stride ``stride_om``) in ``x``'s dtype.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # row offsets: M x N may pass 2^31
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = offs_m < M
    cols_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        wk = k_ok[:, None] & cols_ok[None, :]  # [BLOCK_K, BLOCK_N]
        word = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k // PER)[:, None], mask=wk, other=0)
        q = (word >> ((offs_k % PER) * BITS)[:, None]) & MASK
        g = offs_k // GROUP
        s = tl.load(s_ptr + offs_n[None, :] * G + g[:, None], mask=wk, other=0.0)
        c = tl.load(c_ptr + offs_n[None, :] * G + g[:, None], mask=wk, other=0.0)
        w = q.to(tl.float32) * s + c
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        elif EMULATE:  # Triton's interpreter: its dot of a converted bfloat16 tensor is wrong; the same values in float32
            acc += tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=rows_ok[:, None] & cols_ok[None, :])


def int_gemm(x: torch.Tensor, w: PackedInt, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (one of :data:`DTYPES`) times ``w``'s weights transposed -> ``[M, N]`` in ``x``'s dtype
    (written into ``out`` when given: a ``[M, N]`` view whose columns are contiguous, e.g. a merged layer's slice)."""
    if x.dtype not in DTYPES:
        raise TypeError(f"int_gemm: x is {x.dtype}; it multiplies {', '.join(str(d) for d in DTYPES)}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int_gemm: x has {x.shape[-1]} input features; the weight has {w.in_features}")
    x = (x if w.perm is None else x.index_select(1, w.perm)).contiguous()
    m, n = x.shape[0], w.words.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or (n > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < n):
        raise ValueError(f"int_gemm: out must be {x.dtype} [{m}, {n}] on {x.device} with contiguous, non-overlapping rows; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}, strides {out.stride()}")
    if m == 0 or n == 0:
        return out
    fp32 = x.dtype == torch.float32
    block_n = BLOCK_N_FP32 if fp32 else BLOCK_N
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    int_gemm_kernel[grid](
        x, w.words, w.scales, w.negzs, out, m, n, w.in_features, w.scales.shape[1],
        x.stride(0), w.words.stride(0), out.stride(0),
        BITS=w.bits, GROUP=w.group, UPCAST=fp32, EMULATE=INTERPRET, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )
    return out
