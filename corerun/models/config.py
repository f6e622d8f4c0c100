"""``ModelConfig``: the part of a Hugging Face ``config.json`` that corerun's models read.

Both spellings of the keys that moved between transformers 4 and 5 are accepted:
``dtype`` / ``torch_dtype``, and ``rope_parameters: {rope_theta, rope_type, ...}`` /
``rope_theta`` + ``rope_scaling: {type | rope_type, ...}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from corerun.models.errors import ModelLoadError, UnsupportedModelError, folder_listing

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters.

    ``rope_type`` is one of :data:`ROPE_TYPES`: ``default`` (plain RoPE), ``linear`` (inverse
    frequencies divided by ``factor``), ``llama3`` (Llama 3.1's band-wise scaling, which also reads
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``), ``dynamic``
    (NTK: plain RoPE up to ``max_position_embeddings``, the only lengths corerun runs), ``yarn``
    (``beta_fast``/``beta_slow`` ramp between interpolated and kept frequencies, cos and sin scaled by
    ``attention_factor``, by default from ``mscale``/``mscale_all_dim``) or ``longrope`` (Phi-3:
    frequencies divided by ``short_factor`` per dimension, cos and sin scaled by ``attention_factor``;
    sequences capped at ``original_max_position_embeddings``, see ``ModelConfig.max_model_len``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None  # yarn, longrope: None means the paper's default for ``factor``
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope, one per rotated pair
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the models read from ``config.json`` (plus ``generation_config.json``'s EOS ids, when present)."""

    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # only when the config turns it on
    # per layer, "full_attention" or "sliding_attention", as config.json lists them; () when it does not
    # (the family then decides: ``layer_windows`` on the model class)
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None  # the sliding layers' own rope (Gemma 3's local base), else None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None  # the checkpoint's dtype; None when config.json does not say
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def max_model_len(self) -> int:
        """Longest sequence corerun runs exactly: ``max_position_embeddings``, for ``longrope`` capped at
        ``original_max_position_embeddings``.

        Sliding windows do not cap it: the attention backends attend through each layer's window.
        LongRoPE switches every position of a sequence to its long factors once the sequence outgrows
        the original length (transformers recomputes the whole sequence); corerun's cached keys keep
        their rotation, so it stops at that length.
        """
        limit = self.max_position_embeddings
        if self.rope.rope_type == "longrope" and self.rope.original_max_position_embeddings:
            limit = min(limit, self.rope.original_max_position_embeddings)
        return limit

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a ``config.json`` dict; ``source`` names the file in error messages."""

        if not isinstance(cfg, Mapping):
            raise ModelLoadError(f"{source} must hold a JSON object of settings, got a {type(cfg).__name__}")

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelLoadError(f"{source}: required key {key!r} is missing (present keys: {', '.join(sorted(map(str, cfg)))})")
            return _size(cfg, key, source)

        try:
            return cls._from_dict(cfg, source, need)
        except ModelLoadError:
            raise
        except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:  # a value of the wrong kind
            raise ModelLoadError(f"{source}: a value has the wrong type or range: {type(exc).__name__}: {exc}") from None

    @classmethod
    def _from_dict(cls, cfg: Mapping[str, Any], source: str, need: Any) -> "ModelConfig":
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = cfg.get("head_dim")
        if head_dim is not None:
            head_dim = _size(cfg, "head_dim", source)
        if head_dim is None:
            if hidden % heads:
                raise ModelLoadError(
                    f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, "
                    "and no explicit head_dim is given"
                )
            head_dim = hidden // heads
        kv_heads = cfg.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else _size(cfg, "num_key_value_heads", source)
        if kv_heads < 1 or heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}"
            )
        max_pos = _size(cfg, "max_position_embeddings", source) if cfg.get("max_position_embeddings") else 2048
        archs = cfg.get("architectures") or ()
        if isinstance(archs, str):
            archs = (archs,)
        return cls(
            architectures=tuple(archs),
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg, max_pos, source),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            sliding_window=_sliding_window(cfg),
            layer_types=_layer_types(cfg, int(need("num_hidden_layers")), source),
            local_rope=_local_rope(cfg, max_pos, source),
            bos_token_id=_token_ids(cfg.get("bos_token_id"), f"{source}: bos_token_id")[0] if cfg.get("bos_token_id") is not None else None,
            eos_token_ids=_token_ids(cfg.get("eos_token_id"), f"{source}: eos_token_id"),
            torch_dtype=parse_dtype(cfg.get("dtype", cfg.get("torch_dtype")), source),
            raw=dict(cfg),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``model_dir/config.json``; EOS ids from ``generation_config.json`` are added to the config's own."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not model_dir.is_dir():
            raise ModelLoadError(f"model folder {model_dir} does not exist (or is not a folder)")
        if not path.is_file():
            raise ModelLoadError(
                f"model folder {model_dir} has no config.json; a Hugging Face model folder holds config.json "
                f"and its *.safetensors weights (found: {folder_listing(model_dir)})"
            )
        config = cls.from_dict(_read_json(path), str(path))
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen = _read_json(gen_path)
            extra = _token_ids(gen.get("eos_token_id") if isinstance(gen, Mapping) else None, f"{gen_path}: eos_token_id")
            eos = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
            config = replace(config, eos_token_ids=eos)
        return config


def parse_dtype(value: Any, source: str = "config.json") -> torch.dtype | None:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``; ``None`` / ``"auto"`` -> ``None``."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelLoadError(f"{source}: dtype {value!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def parse_rope(cfg: Mapping[str, Any], max_position_embeddings: int, source: str = "config.json") -> RopeConfig:
    """Read ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = dict(cfg.get("rope_parameters") or {})
    if params and any(isinstance(v, Mapping) for v in params.values()):
        unknown = set(params) - set(LAYER_TYPES)
        if unknown:
            raise UnsupportedModelError(
                f"{source}: rope_parameters per layer type names {', '.join(sorted(unknown))}; corerun reads "
                f"{' and '.join(LAYER_TYPES)}"
            )
        params = dict(params.get("full_attention") or {})  # the sliding layers' own: ``_local_rope``
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; corerun supports {', '.join(ROPE_TYPES)}"
        )
    original = merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn", "longrope") and original is None:
        original = max_position_embeddings
    factor = merged.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_position_embeddings / int(original)  # the ratio the checkpoint was extended by
    factor = float(factor or 1.0)
    if rope_type == "default":
        factor = 1.0
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(merged.get(key) or ()) != _head_dim(cfg) // 2:
                raise ModelLoadError(f"{source}: rope {key} must list head_dim / 2 = {_head_dim(cfg) // 2} factors, "
                                     f"got {merged.get(key)!r}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
        attention_factor=_optional_float(merged.get("attention_factor")),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=_optional_float(merged.get("mscale")),
        mscale_all_dim=_optional_float(merged.get("mscale_all_dim")),
        truncate=bool(merged.get("truncate", True)),
        short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _head_dim(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(cfg: Mapping[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    """``layer_types`` as config.json lists them (checked: one known type per layer), or ``()``."""
    given = cfg.get("layer_types")
    if given is None:
        return ()
    if not isinstance(given, (list, tuple)) or len(given) != num_layers or any(t not in LAYER_TYPES for t in given):
        raise ModelLoadError(f"{source}: layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                             f"{num_layers} layers (num_hidden_layers), got {given!r}")
    return tuple(given)


def _local_rope(cfg: Mapping[str, Any], max_pos: int, source: str) -> RopeConfig | None:
    """The sliding layers' rope where it differs by layer type: transformers 5's
    ``rope_parameters: {sliding_attention: {...}}``, transformers 4's ``rope_local_base_freq`` (Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if isinstance(local, Mapping):
        return parse_rope({"rope_parameters": dict(local), "head_dim": cfg.get("head_dim"),
                           "hidden_size": cfg["hidden_size"], "num_attention_heads": cfg["num_attention_heads"]},
                          max_pos, f"{source} (rope_parameters.sliding_attention)")
    if cfg.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(cfg["rope_local_base_freq"]))
    return None


def _sliding_window(cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


MAX_SIZE = 2**31 - 1  # sizes (layers, heads, widths, vocabulary, positions) are int32 somewhere


def _size(cfg: Mapping[str, Any], key: str, source: str) -> int:
    """``cfg[key]`` as a size: an integer in [1, MAX_SIZE] (``4096.0`` is allowed), else a ModelLoadError naming it."""
    v = cfg[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
        raise ModelLoadError(f"{source}: {key} must be a whole number in [1, {MAX_SIZE}], got {v!r}")
    return v


def _token_ids(value: Any, what: str = "token id") -> tuple[int, ...]:
    """An id or a list of ids (``eos_token_id: 2`` / ``[2, 7]``); anything else is a ModelLoadError naming ``what``."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ModelLoadError(f"{what} must be a token id (an integer >= 0) or a list of them, got {value!r}")
    return tuple(values)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON (UTF-8): {str(exc)[:300]}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object of settings, got a {type(data).__name__}")
    return data
