"""Plugins that fail on purpose, to prove the engine survives them.

Each wraps a real implementation and delegates everything to it, except that one chosen call raises
:class:`InjectedFault` (a plain ``RuntimeError``, as a buggy kernel or allocator would raise):

- attention ``faulty_attention``: the torch reference; its ``fail_at``-th ``forward`` call (counting
  every layer of every step from 1) raises, so with ``fail_at = 2 * s`` on a two-layer model the fault
  comes in the *second* layer of step ``s``, after the first one wrote that step's K/V into the cache;
- KV-cache manager ``faulty_kv``: ``paged``; its ``fail_at``-th call of ``method`` (``allocate_slots``,
  the default, ``get_computed_prefix``, ``block_table`` or ``cache_blocks``) raises, or with
  ``error="refuse"`` ``allocate_slots`` reports no room (``None``) however many blocks are free;
- sampler ``faulty_sampler``: ``full``; its ``fail_at``-th ``sample`` call raises;
- sampler ``lying_sampler``: ``full``, but its ``fail_at``-th ``sample`` call returns a token id
  outside the vocabulary instead of raising.

``times`` (default 1) makes that many consecutive calls fail; ``fail_at = 0`` never fails;
``error="oom"`` raises ``torch.OutOfMemoryError`` instead, as an allocation inside a kernel would on a
full device.  Every fault message carries the word ``injected`` and the call number, so a test can
find it in an error.

Register them into a registry with ``registry.register_module(faulty_plugins, plugin="faulty",
distribution="corerun-faulty-plugins", version="0")`` and select them by name in the config, with
options: ``attention={"name": "faulty_attention", "options": {"fail_at": 6}}``.

``RaisingHook`` is a plugin object whose hook raises while registering, and ``broken_entry_point``
names a module that does not exist: neither may keep the other plugins from loading.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from corerun import hookimpl
from corerun.attention.torch_backend import CAPABILITIES as TORCH_CAPABILITIES
from corerun.attention.torch_backend import TorchAttentionBackend
from corerun.plugin.capabilities import KVCacheCapabilities
from corerun.kv_cache.paged import PagedKVCacheManager
from corerun.protocols import AttentionSpec, SamplerOutput, SamplingMetadata

DISTRIBUTION = "corerun-faulty-plugins"
broken_entry_point = "corerun_no_such_plugin_module.plugin"


class InjectedFault(RuntimeError):
    """The error a faulty plugin raises."""


class FaultOptions(BaseModel):
    """``fail_at``: the 1-based call that fails first (0: never); ``times``: how many consecutive calls fail;
    ``error``: what they raise."""

    model_config = ConfigDict(extra="forbid")
    fail_at: int = Field(1, ge=0)
    times: int = Field(1, ge=1)
    error: Literal["runtime", "oom"] = "runtime"


class KVFaultOptions(FaultOptions):
    """``method``: the KV-cache manager call that fails; ``error="refuse"``: ``allocate_slots`` returns
    ``None`` (no room) instead of raising, even with the whole cache free."""

    method: Literal["allocate_slots", "get_computed_prefix", "block_table", "cache_blocks"] = "allocate_slots"
    error: Literal["runtime", "oom", "refuse"] = "runtime"


class _Trigger:
    """Counts calls; says which ones fail."""

    def __init__(self, what: str, fail_at: int, times: int, error: str = "runtime") -> None:
        self.what, self.fail_at, self.times, self.error = what, fail_at, times, error
        self.calls = 0
        self.faults = 0

    def tick(self) -> bool:
        """Count one call; True when this call must fail."""
        self.calls += 1
        fail = self.fail_at > 0 and self.fail_at <= self.calls < self.fail_at + self.times
        self.faults += fail
        return fail

    def fault(self) -> Exception:
        message = f"injected fault in {self.what}, call {self.calls}"
        if self.error == "oom":
            return torch.OutOfMemoryError(f"{message}: out of memory, tried to allocate 2.00 GiB")
        return InjectedFault(message)


class FaultyAttention(TorchAttentionBackend):
    """The torch reference backend; forward call number ``fail_at`` (and the ``times - 1`` after it) raises."""

    name: ClassVar[str] = "faulty_attention"

    def __init__(self, spec: AttentionSpec, fail_at: int = 1, times: int = 1, error: str = "runtime") -> None:
        super().__init__(spec)
        self.trigger = _Trigger("attention forward", fail_at, times, error)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.trigger.tick():
            raise self.trigger.fault()
        return super().forward(query, key, value, kv_cache, metadata, out)


class FaultyKVCache(PagedKVCacheManager):
    """The ``paged`` manager; call number ``fail_at`` of ``method`` raises before changing anything.

    ``failed_seq_ids`` lists the sequence each fault hit.
    """

    name: ClassVar[str] = "faulty_kv"

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, fail_at: int = 1, times: int = 1,
                 error: str = "runtime", method: str = "allocate_slots") -> None:
        super().__init__(num_blocks, block_size, prefix_caching=prefix_caching)
        self.method = method
        self.trigger = _Trigger(f"KV-cache {method}", fail_at, times, error)
        self.failed_seq_ids: list[int] = []

    def _maybe_fail(self, method: str, seq_id: int) -> bool:
        """Raise, or return True for a refusal, when this call of ``method`` is to fail."""
        if method == self.method and self.trigger.tick():
            self.failed_seq_ids.append(seq_id)
            if self.trigger.error == "refuse":
                return True
            raise self.trigger.fault()
        return False

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        if self._maybe_fail("allocate_slots", seq_id):
            return None
        return super().allocate_slots(seq_id, num_tokens)

    def get_computed_prefix(self, seq_id: int, token_ids: Any) -> int:
        self._maybe_fail("get_computed_prefix", seq_id)
        return super().get_computed_prefix(seq_id, token_ids)

    def block_table(self, seq_id: int) -> list[int]:
        self._maybe_fail("block_table", seq_id)
        return super().block_table(seq_id)

    def cache_blocks(self, seq_id: int, token_ids: Any, num_computed_tokens: int) -> None:
        self._maybe_fail("cache_blocks", seq_id)
        super().cache_blocks(seq_id, token_ids, num_computed_tokens)


def _full_sampler(vocab_size: int, device: torch.device | str) -> Any:
    from corerun.sampler.full import FullSampler

    return FullSampler(vocab_size, device)


class FaultySampler:
    """The ``full`` sampler; ``sample`` call number ``fail_at`` raises."""

    name: ClassVar[str] = "faulty_sampler"

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", fail_at: int = 1, times: int = 1,
                 error: str = "runtime") -> None:
        self.inner = _full_sampler(vocab_size, device)
        self.capabilities = self.inner.capabilities
        self.trigger = _Trigger("sampler sample", fail_at, times, error)

    def check(self, params: Any) -> None:
        self.inner.check(params)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if self.trigger.tick():
            raise self.trigger.fault()
        return self.inner.sample(logits, metadata)

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> Any:
        return self.inner.prompt_logprobs(logits, token_ids, num_logprobs)


class LyingSampler(FaultySampler):
    """The ``full`` sampler; call number ``fail_at`` returns ``vocab_size`` (outside the vocabulary) for every row."""

    name: ClassVar[str] = "lying_sampler"

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        out = self.inner.sample(logits, metadata)
        if self.trigger.tick():
            return SamplerOutput(torch.full_like(out.sampled_token_ids, logits.shape[-1]), out.logprobs)
        return out


@hookimpl
def corerun_attention_backends(register: Any) -> None:
    register("faulty_attention", FaultyAttention, capabilities=TORCH_CAPABILITIES, options=FaultOptions,
             priority=-100, description="torch reference that raises on a chosen forward call")


@hookimpl
def corerun_kv_cache_managers(register: Any) -> None:
    register("faulty_kv", FaultyKVCache, capabilities=KVCacheCapabilities(prefix_caching=True), options=KVFaultOptions,
             description="paged manager that raises on a chosen call of a chosen method")


@hookimpl
def corerun_samplers(register: Any) -> None:
    from corerun.sampler.options import CAPABILITIES as FULL_CAPABILITIES

    register("faulty_sampler", FaultySampler, capabilities=FULL_CAPABILITIES, options=FaultOptions,
             description="full sampler that raises on a chosen sample call")
    register("lying_sampler", LyingSampler, capabilities=FULL_CAPABILITIES, options=FaultOptions,
             description="full sampler that returns an out-of-vocabulary token on a chosen call")


class RaisingHook:
    """A plugin whose hook raises while registering (as a plugin with a bug in its entry point would)."""

    @hookimpl
    def corerun_samplers(self, register: Any) -> None:
        raise InjectedFault("injected fault while registering samplers")
