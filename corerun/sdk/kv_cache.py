"""KV-cache manager building blocks: corerun's ``paged`` manager as a base class.

:class:`PagedKVCacheManager` is the whole protocol (block pool, reference counts, prefix caching by
chained content hashes, least recently freed cached blocks evicted first); a plugin subclasses it and
overrides the methods whose policy it changes, as ``corerun new kv_cache NAME`` generates.
"""

from __future__ import annotations

from corerun.kv_cache.paged import PagedKVCacheManager

__all__ = ["PagedKVCacheManager"]
