"""``model:`` as a Hugging Face Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``): the local snapshot
folder of it, downloaded through ``huggingface_hub`` (with its progress bars) unless it is cached.

A value that names an existing path is a folder and is used as it is; only ``owner/name`` that is not a
path here is taken for a Hub id.  ``HF_HUB_OFFLINE=1`` keeps to the cache (``HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``); a model that is not there is an error naming both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from corerun.models.errors import ModelLoadError

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
# what a model folder needs: config, weights, tokenizer (no pickled or ONNX duplicates of the weights)
FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def is_hub_id(model: str) -> bool:
    """``owner/name`` that is not a path on this machine."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


def with_local_model(config: Any) -> Any:
    """``config`` (a :class:`corerun.config.Config`) with a Hub id in ``model`` replaced by its local snapshot folder."""
    if config.model and is_hub_id(str(config.model)):
        update: dict[str, Any] = {"model": resolve_model(str(config.model))}
        if not config.server.served_model_name:  # served under the id the user gave, not the snapshot's hash
            update["server"] = config.server.model_copy(update={"served_model_name": str(config.model)})
        return config.model_copy(update=update)
    return config


def resolve_model(model: str) -> str:
    """``model`` itself when it is a folder (or not a Hub id); for a Hub id, its local snapshot folder."""
    if not is_hub_id(model):
        return model
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelLoadError(
            f"model {model!r} is not a folder here, and looks like a Hugging Face Hub id; downloading it needs "
            "huggingface_hub: pip install huggingface_hub (or pip install 'corerun[default]'), or give a local folder"
        ) from None
    cache = constants.HF_HUB_CACHE
    try:
        return snapshot_download(model, allow_patterns=FILES, cache_dir=cache)
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"model {model!r} is not a folder here and not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE=1 "
                "forbids downloading it: unset HF_HUB_OFFLINE on a machine that reaches huggingface.co (the download "
                "lands in that cache), or give a local model folder"
            ) from None
        raise ModelLoadError(
            f"model {model!r} is not a folder here and not in the Hugging Face cache {cache}, and the Hub could not "
            "be reached to download it; connect to the network, or copy the model into that cache (then "
            "HF_HUB_OFFLINE=1 uses it without asking the Hub), or give a local model folder"
        ) from None
    except Exception as exc:  # no such repository, a gated one, a full disk: the Hub's own words
        raise ModelLoadError(
            f"model {model!r}: downloading it from the Hugging Face Hub into {cache} failed: {type(exc).__name__}: "
            f"{exc}; check the id (owner/name, as on huggingface.co) or give a local model folder"
        ) from None
