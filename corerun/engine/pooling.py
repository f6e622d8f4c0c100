"""A model's own pooling, read from its folder, and the parameters of an embedding request.

sentence-transformers folders say how they pool: ``modules.json`` lists the modules (a ``Pooling``
module in a folder such as ``1_Pooling`` with its ``config.json``, and ``Normalize`` when the vectors
are normalised).  Without ``modules.json`` the default is vLLM's for causal language models: the last
token's hidden state, normalised.  A model that supports truncated vectors (Matryoshka) says so in its
``config.json`` with ``matryoshka_dimensions`` (a list) or ``is_matryoshka: true``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from corerun.errors import RequestError
from corerun.models.errors import ModelLoadError
from corerun.sampling_params import PoolingParams, SamplingParams

# sentence-transformers' pooling flags -> corerun's pooling types (the others are not supported)
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class ModelPooling:
    """How the model pools; ``source`` names where that was read (a file, or the default)."""

    pooling_type: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    source: str = "default (last token, normalised)"
    hidden_size: int | None = None  # the vectors' length (config.json), the most ``dimensions`` may keep


def read_model_pooling(model_dir: str | Path) -> ModelPooling:
    """The pooling ``model_dir`` declares; raises ModelLoadError naming the file for a pooling corerun lacks."""
    folder = Path(model_dir)
    matryoshka, dims, hidden = _model_config(folder / "config.json")
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return ModelPooling(matryoshka=matryoshka, matryoshka_dimensions=dims, hidden_size=hidden)
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{modules_file}: must be a list of modules ({{\"type\": ..., \"path\": ...}}), "
                             f"got {json.dumps(modules)[:80]}")
    types = [str(m.get("type", "")) for m in modules]
    pooling_dir = next((m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    extra = [t for t in types if t.rsplit(".", 1)[-1] not in ("Transformer", "Pooling", "Normalize")]
    if extra:
        raise ModelLoadError(f"{modules_file}: modules {extra} are not supported for embeddings; corerun pools "
                             "with Transformer, Pooling and Normalize modules only")
    normalize = any(t.endswith(".Normalize") for t in types)
    if pooling_dir is None:
        return ModelPooling("last", normalize, matryoshka, dims, str(modules_file), hidden)
    config_file = folder / pooling_dir / "config.json"
    config = _read_json(config_file)
    on = [k for k in (*_MODES, *_UNSUPPORTED) if config.get(k)]
    if len(on) != 1 or on[0] not in _MODES:
        raise ModelLoadError(f"{config_file}: pooling modes {on or 'none'} are set; corerun pools with exactly one of "
                             f"{list(_MODES)} (last token, mean, CLS), set to true")
    if config.get("include_prompt", True) is not True:
        raise ModelLoadError(f"{config_file}: include_prompt={config['include_prompt']!r} (pooling without the "
                             "prompt's instruction tokens) is not supported; corerun pools over every token: "
                             "include_prompt must be true or absent")
    return ModelPooling(_MODES[on[0]], normalize, matryoshka, dims, str(config_file), hidden)


def embedding_params(model: ModelPooling, dimensions: int | None = None, *, field: str = "dimensions") -> SamplingParams:
    """The parameters of one embedding request: the model's pooling, truncated to ``dimensions`` where
    the model supports it (RequestError naming ``field`` otherwise)."""
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise RequestError(f"{field} must be a positive integer, got {dimensions!r}")
        if not model.matryoshka:
            raise RequestError(f"{field}={dimensions} was given but this model does not support truncated embeddings "
                               "(its config.json declares no matryoshka_dimensions); leave it out")
        if model.matryoshka_dimensions and dimensions not in model.matryoshka_dimensions:
            raise RequestError(f"{field}={dimensions} is not one the model was trained for; use one of "
                               f"{list(model.matryoshka_dimensions)}")
        if model.hidden_size is not None and dimensions > model.hidden_size:
            raise RequestError(f"{field}={dimensions} is more than the model's {model.hidden_size} values per "
                               f"vector; ask for 1 to {model.hidden_size}")
    pooling = PoolingParams(pooling_type=model.pooling_type, normalize=model.normalize, dimensions=dimensions)
    return SamplingParams(max_tokens=1, pooling=pooling)


def _model_config(config_file: Path) -> tuple[bool, tuple[int, ...], int | None]:
    """Matryoshka (declared, and the sizes listed) and the hidden size, from ``config.json``."""
    if not config_file.is_file():
        return False, (), None
    config = _read_json(config_file)
    dims = config.get("matryoshka_dimensions") or ()
    hidden = config.get("hidden_size")
    return (bool(dims) or bool(config.get("is_matryoshka")), tuple(int(d) for d in dims),
            hidden if isinstance(hidden, int) else None)


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: could not be read as JSON: {exc}") from exc
