"""float32 -> bfloat16 with round-to-nearest-even, for the interpreter (whose own cast truncates)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """``x`` float32 (any shape) -> bfloat16, nearest even, by integer arithmetic on the bits.

    Compiled kernels use ``x.to(tl.bfloat16)``, which already rounds to nearest even; Triton's
    interpreter truncates instead (up to one bfloat16 ulp, 2**-7 relative, of extra error).
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
