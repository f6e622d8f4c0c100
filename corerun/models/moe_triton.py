"""The mixture-of-experts experts kernel for CUDA: one Triton grouped GEMM launch per projection.

:func:`triton_experts` computes what :func:`corerun.models.moe.experts_reference` computes:

1. the ``T * k`` (token, slot) pairs are ordered by expert (a stable sort; ``starts`` / ``counts``
   per expert), with no host sync: the grid ``(cdiv(T * k, BLOCK_M), E, cdiv(N, BLOCK_N))`` depends on
   shapes only, and programs past their expert's pairs return at once;
2. :func:`experts_kernel` with ``GATED``: for each pair, its token's row of ``x`` times the expert's
   gate rows and up rows, ``silu(gate) * up`` stored per pair ``[T * k, I]``;
3. :func:`experts_kernel` without: each pair's row times the expert's ``down`` ``[H, I]``, scaled by the
   pair's routing weight, stored per pair ``[T * k, H]``, summed over the ``k`` slots of each token.

Accumulation in float32 (float32 products without TF32); inputs float16, bfloat16 or float32.  Off
CUDA (tests) the kernel runs in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before this
module was imported.  ``scripts/compile_check_moe.py`` compiles both launches for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_N = 64  # float16 / bfloat16; float32's ieee products take twice the registers: BLOCK_N_FP32
BLOCK_N_FP32 = 32
BLOCK_K = 32
NUM_WARPS = 8  # 4 spill the gated float32 launch's two accumulators on sm_90 (scripts/compile_check.py)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def experts_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    scale_ptr,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    SCALED: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program ``(m, e, n)``: the ``m``-th block of ``BLOCK_M`` pairs routed to expert ``e``, output
    columns ``n * BLOCK_N ..``.

    - ``a_ptr``: the rows multiplied, ``[rows, K]`` (row stride ``stride_am``, columns contiguous);
      pair ``p`` reads row ``p // A_ROW_DIV`` (``k``: its token's hidden state; 1: its own row);
    - ``w_ptr``: ``[E, rows_w, K]`` stacked expert weights (strides ``stride_we``, ``stride_wn``, 1):
      with ``GATED`` rows ``0 .. N`` are the gate and ``N .. 2N`` the up projection;
    - ``out_ptr``: ``[T * k, N]`` (row stride ``stride_om``), row ``p`` written for every pair ``p``:
      ``silu(a @ gate.T) * (a @ up.T)`` when ``GATED``, else ``a @ w.T`` times ``scale[p]`` when ``SCALED``;
    - ``order_ptr``: int64 ``[T * k]``, the pairs ordered by expert; ``starts_ptr`` / ``counts_ptr``:
      int64 ``[E]``, where expert ``e``'s pairs start in ``order`` and how many;
    - ``scale_ptr``: float32 ``[T * k]``, each pair's routing weight.

    ``UPCAST``: products in float32 (the interpreter's ``tl.dot`` is wrong on bfloat16).
    """
    pid_m = tl.program_id(0)
    expert = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(counts_ptr + expert)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    pairs = tl.load(order_ptr + tl.load(starts_ptr + expert) + offs_m, mask=mask_m, other=0)
    a_rows = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_base + (N + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision="ieee")
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SCALED:
        acc = acc * tl.load(scale_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
            counts: torch.Tensor, scale: torch.Tensor, n: int, a_row_div: int, gated: bool) -> None:
    pairs, e = out.shape[0], w.shape[0]
    block_n = BLOCK_N_FP32 if a.dtype == torch.float32 else BLOCK_N
    grid = (triton.cdiv(pairs, BLOCK_M), e, triton.cdiv(n, block_n))
    experts_kernel[grid](
        a, w, out, order, starts, counts, scale, n, a.shape[1], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, SCALED=not gated, UPCAST=INTERPRET or a.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )


def triton_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """``x`` ``[T, H]``, ``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, ``weights``/``ids`` ``[T, k]`` -> ``[T, H]``
    (the dtype of ``x``, one of :data:`DTYPES`; every tensor on one device)."""
    t, k = ids.shape
    e, two_i, h = gate_up.shape
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=e)
    starts = counts.cumsum(0) - counts
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(t * k, two_i // 2, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, act, order, starts, counts, scale, two_i // 2, k, gated=True)
    per_pair = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
    _launch(act, down, per_pair, order, starts, counts, scale, h, 1, gated=False)
    return per_pair.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
