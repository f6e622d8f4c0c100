"""Options shared by the commands that build an engine (generate, bench)."""

from __future__ import annotations

from typing import Any, Callable

import click


def engine_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        [
            click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file."),
            click.option("--model", help="Hugging Face model folder, or Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct (default: the built-in SmolLM2-135M-Instruct)."),
            click.option("--attention", help="Attention backend (auto, torch, triton, flash, ...)."),
            click.option("--sampler", help="Sampler (full, basic, ...)."),
            click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Device."),
            click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), help="Model dtype."),
            click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Any config key, e.g. kv_cache.block_size=32 (repeatable)."),
        ]
    ):
        f = opt(f)
    return f


def build_config(config_path: str | None, sets: tuple[str, ...], **overrides: Any) -> Any:
    """The config from the YAML file, the flags and ``--set``; a ``model`` that is a Hugging Face Hub id
    (``owner/name``, not a folder here) becomes its local snapshot folder (corerun.models.hub)."""
    from corerun.config import load_config
    from corerun.models.hub import with_local_model

    return with_local_model(load_config(config_path, overrides={k: v for k, v in overrides.items() if v is not None}, sets=list(sets)))
