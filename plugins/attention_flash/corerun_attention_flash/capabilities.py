"""What the ``flash`` backend declares: flash-attn's limits as plain data (imports no torch, no flash_attn).

The declaration is static, so it states what *every* supported flash-attn install can serve:

- dtypes: float16 and bfloat16 (flash-attn has no float32 kernels).
- head sizes: multiples of 8 up to 256.  Both FA2 and FA3 stop at 256; a head size that is not a
  multiple of 8 makes flash-attn pad the whole paged cache on every call (a copy per layer), and
  ``flash_attn_with_kvcache`` does not pad at all.
- block sizes: multiples of 256.  FA2 (``flash_attn``) reads a paged KV cache only with
  ``page_block_size % 256 == 0``.  FA3 (``flash_attn_interface``, Hopper) accepts any page size, but a
  declaration cannot depend on which of the two is installed: ``attention: auto`` and the
  conformance suite trust it before the backend is built.  The backend re-checks the installed
  library's own limits at construction (see ``kernels.installed_limit_reasons``), so widening this
  set for FA3 would still fail at startup, with the reason, on an FA2 install.
- devices: CUDA only, compute capability 8.0 or newer (checked by the probe and at construction).
"""

from __future__ import annotations

from corerun.sdk import AttentionCapabilities

FA2_PAGE_MULTIPLE = 256  # flash_attn (FA2): "Paged KV cache block size must be divisible by 256"
MAX_HEAD_SIZE = 256
HEAD_SIZE_MULTIPLE = 8
MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere
FA3_COMPUTE_CAPABILITY = (9, 0)  # Hopper: the only GPUs corerun uses flash_attn_interface (FA3) on

FLASH_CAPABILITIES = AttentionCapabilities(
    dtypes=frozenset({"float16", "bfloat16"}),
    head_sizes=frozenset(range(HEAD_SIZE_MULTIPLE, MAX_HEAD_SIZE + 1, HEAD_SIZE_MULTIPLE)),
    block_sizes=frozenset(range(FA2_PAGE_MULTIPLE, 2048 + 1, FA2_PAGE_MULTIPLE)),
    devices=frozenset({"cuda"}),
    gqa=True,
    cuda_graph_decode=True,
)
