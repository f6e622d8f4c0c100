"""When decodes take the split-KV (flash-decoding) path, and how many slices: host integers only.

The rule reads nothing but shapes a CUDA-graph capture already fixes (the number of decodes, the
number of KV heads, the ``max_seq_len`` bound, the device's SM count), never the sequence lengths
themselves, so the graph captured for a batch size always takes the path it was captured with.
Inside the kernel each decode cuts its own keys into that many slices of whole tiles; slices past
its end are empty and cost one early-exiting program.
"""

from __future__ import annotations

MAX_SPLITS = 64
SPLIT_MIN_SEQ_LEN = 1024  # shorter bounds: one program per (decode, KV head) finishes quickly enough
SPLIT_MIN_KEYS = 256  # each slice gets at least this many keys of a max_seq_len sequence
WAVES = 2  # aim for this many programs per SM


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int | None) -> int:
    """Slices per decode: 1 (no split) or a power of two up to :data:`MAX_SPLITS`.

    Split only when the decodes alone give fewer programs (``num_decodes * num_kv_heads``) than the
    device has SMs and ``max_seq_len >= SPLIT_MIN_SEQ_LEN``; then aim for ``WAVES * num_sms`` programs,
    with at least ``SPLIT_MIN_KEYS`` keys per slice at ``max_seq_len``.  ``num_sms=None`` (the
    interpreter, which runs programs one after another) never splits.
    """
    if num_sms is None or num_decodes <= 0 or max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1
    programs = num_decodes * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = min(-(-WAVES * num_sms // programs), max_seq_len // SPLIT_MIN_KEYS, MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1
