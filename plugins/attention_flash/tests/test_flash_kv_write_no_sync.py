"""The KV write must be CUDA-graph safe: no host sync. On the meta device any ``.item()`` raises."""

import torch

from corerun_attention_flash.kv_write import write_kv_by_slot


def test_write_kv_needs_no_host_sync():
    key = torch.empty(4, 2, 8, device="meta")
    value = torch.empty(4, 2, 8, device="meta")
    cache = torch.empty(2, 3, 4, 2, 8, device="meta")
    slots = torch.empty(4, dtype=torch.int64, device="meta")
    write_kv_by_slot(key, value, cache, slots)  # raises "cannot be called on meta tensors" on a sync
