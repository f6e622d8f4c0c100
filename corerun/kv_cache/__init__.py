"""KV-cache bookkeeping: the built-in ``paged`` manager and the ``num_blocks: auto`` sizing rule.

Importing this package does not import torch.
"""

from corerun.kv_cache.paged import PagedKVCacheManager, chained_hash
from corerun.kv_cache.sizing import num_blocks_for_budget

__all__ = ["PagedKVCacheManager", "chained_hash", "num_blocks_for_budget"]
