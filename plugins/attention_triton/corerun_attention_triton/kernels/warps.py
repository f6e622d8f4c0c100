"""Warps for the launches that are never autotuned: the decode kernels' one rule.

Decodes run inside CUDA graphs, so their launches cannot autotune; prefill launches do (see
``unified_attention``).  Both decode kernels (``split_kv_decode`` and ``unified_attention`` on a
decode-only batch) hold a float32 accumulator ``[rows, HEAD_PAD]`` and the K and V tiles
``[TILE_N, HEAD_PAD]`` of one step in registers, shared by ``32 * num_warps`` threads.
"""

from __future__ import annotations


def decode_num_warps(head_pad: int) -> int:
    """8 warps at a padded head size of 128, 4 otherwise.

    ``ptxas`` for sm_90 (Triton 3.7), both kernels, fp16 and bf16, with the plan's tiles
    (``TILE_N`` 64 up to ``HEAD_PAD`` 128, 32 above):

    - ``HEAD_PAD`` 128 with 4 warps: 255 registers and 640-828 bytes spilled a thread; with 8: 226-252
      registers, no spill.
    - ``HEAD_PAD`` 256: the halved key tile already fits 4 warps (217-248 registers, no spill), while
      8 warps spill the unified kernel (44 bytes).
    - ``HEAD_PAD`` 64 and below: 4 warps, no spill.

    ``scripts/compile_check.py`` prints these figures and fails if a decode launch spills.
    """
    return 8 if head_pad == 128 else 4
