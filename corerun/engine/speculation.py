"""Building speculative decoding for an engine: the proposer ``speculative.method`` names (for
``draft_model``, a ModelRunner of ``speculative.model``) under the policy of :class:`SpecDecoder`."""

from __future__ import annotations

from typing import Any

from corerun.config import Config
from corerun.errors import ConfigError
from corerun.plugin.registry import Registry
from corerun.runner.model_runner import ModelRunner
from corerun.spec_decode import DraftModelProposer, NgramProposer, SpecDecoder


def make_spec_decoder(config: Config, runner: Any, registry: Registry | None) -> SpecDecoder | None:
    """The speculative decoder of ``config.speculative`` (docs/speculative-decoding.md), or None when it is off."""
    spec = config.speculative
    if spec.method is None:
        return None
    if not getattr(runner.sampler.capabilities, "draft_verification", False):
        raise ConfigError(
            f"speculative.method: {spec.method!r} needs a sampler that verifies draft tokens "
            f"(SamplerCapabilities.draft_verification), and sampler '{runner.sampler_name}' does not "
            "declare it; use sampler: full or basic, or leave speculative.method unset"
        )
    if spec.method == "draft_model":
        proposer: Any = _draft_proposer(config, runner, registry)
    else:
        proposer = NgramProposer(spec.num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return SpecDecoder(proposer, max_model_len=runner.max_model_len, one_row=runner.logits_processors.wanted)


def _draft_proposer(config: Config, target: Any, registry: Registry | None) -> DraftModelProposer:
    """``speculative.method: draft_model``: a ModelRunner of ``speculative.model`` with the target's
    settings, a cache of as many blocks as the target's plus room for each request's drafts (no
    prefix caching: its blocks hold drafts the target may reject), the target's max_model_len."""
    import torch

    spec, sc = config.speculative, config.scheduler
    slack = sc.max_num_seqs * -(-(spec.num_tokens + 1) // target.block_size)
    draft_config = config.model_copy(update={
        "model": spec.model,
        "speculative": type(spec)(),
        "kv_cache": config.kv_cache.model_copy(update={"num_blocks": target.num_blocks + slack, "prefix_caching": False}),
        "scheduler": sc.model_copy(update={"max_model_len": target.max_model_len}),
    })
    try:
        runner = ModelRunner(draft_config, registry)
    except (ConfigError, OSError, ValueError, torch.OutOfMemoryError) as exc:
        raise ConfigError(
            f"speculative.model {spec.model!r}: the draft model cannot be loaded: {type(exc).__name__}: {exc} "
            f"(it is loaded after the model's KV cache, and its own cache has {target.num_blocks + slack} blocks: "
            "the model's plus room for drafts; with kv_cache.num_blocks: auto on a GPU, lower "
            "kv_cache.memory_fraction to leave it room)"
        ) from exc
    if runner.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative.model {spec.model!r} has a vocabulary of {runner.vocab_size} tokens and the model "
            f"{target.vocab_size}; a draft model must share the model's tokenizer and vocabulary size"
        )
    return DraftModelProposer(
        runner, spec.num_tokens, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=runner.max_num_batched_tokens,
    )
