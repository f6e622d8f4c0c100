"""Load a Hugging Face model folder (``config.json`` + safetensors) into one of corerun's models.

Rules:

- weights come from ``model.safetensors.index.json`` and the shards it names, else from
  ``model.safetensors``, else from every ``*.safetensors`` file in the folder;
- a folder with only pickle weights (``pytorch_model*.bin``) is refused unless ``allow_pickle``
  (unpickling a file can run code); with it they load through ``torch.load(weights_only=True)``;
  the rule holds for every file, whichever index names it: ``model.safetensors.index.json`` may name
  only ``.safetensors`` files;
- every weight file must be inside the model folder once symlinks are resolved (no ``../``, no
  absolute paths, no links out), except links into a Hugging Face hub cache's own ``blobs/``;
- before anything is allocated, the model ``config.json`` describes must fit in the weight files
  (a config claiming a million layers is refused, not allocated until memory runs out);
- every parameter must be filled (every shard of a merged one), every checkpoint tensor must land
  somewhere (rotary ``inv_freq`` / ``cos_cached`` / ``sin_cached`` buffers are ignored), and every
  shape must match: the error lists all problems at once, with both shapes for each mismatch.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Iterator, Union

import torch
from torch import nn

from corerun.models.config import ModelConfig, parse_dtype
from corerun.models.errors import ModelLoadError, UnsupportedModelError, folder_listing
from corerun.models.layers import WeightShapeError, prepack_cpu_weights, use_cpu_matvec_layout
from corerun.quantization.checkpoint import gguf_file_of, quantization_config
from corerun.quantization.gguf_file import gguf_weights
from corerun.models.registry import model_family

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_SHOWN = 20  # names listed per kind of problem

DtypeChoice = Union[torch.dtype, str, None, Callable[[Union[torch.dtype, None]], torch.dtype]]


def load_model(
    model_dir: str | Path,
    dtype: DtypeChoice = "auto",
    device: torch.device | str = "cpu",
    allow_pickle: bool = False,
    tp: "TensorParallelGroup | None" = None,
    quant: "QuantizationMethod | None" = None,
    layers: tuple[int, int] | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model ``config.json`` names, on ``device`` in ``dtype``, and fill it from the folder's weights.

    ``dtype``: a ``torch.dtype`` or its name; ``"auto"`` / ``None`` takes the checkpoint's own (``dtype``
    / ``torch_dtype`` in ``config.json``), float32 when it does not say; or a callable given the
    checkpoint's dtype (``None`` when unknown) that returns the dtype to use.
    ``tp``: this process's tensor-parallel group; the model is built with, and loads, this rank's slices.
    ``quant``: the quantization method of the model's linear layers (``None``: dense float weights).
    ``layers``: a pipeline stage's decoder layers ``(start, end)``: the model keeps only what the stage
    runs (its ``keep_layers``) and only those weights are read.
    Returns ``(model, config)``, the model in eval mode with every parameter loaded.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    family = model_family(config)
    model_cls = family.cls
    files = find_weight_files(model_dir, allow_pickle=allow_pickle)
    check_size_against_weights(config, files, model_dir, quantized=quantization_config(model_dir) is not None)
    if callable(dtype):
        dtype = dtype(config.torch_dtype)
    dtype = parse_dtype(dtype, "dtype argument") or config.torch_dtype or torch.float32
    if tp is not None and not family.capabilities.tensor_parallel:
        raise UnsupportedModelError(
            f"model family {family.architecture} ({family.registration.distribution}) declares tensor_parallel=False: "
            "it does not support tensor parallelism; use tensor_parallel_size: 1"
        )
    with _default_dtype(dtype), torch.device(device):
        extra = {} if quant is None else {"quant": quant}
        model = model_cls(config, **extra) if tp is None else model_cls(config, tp=tp, **extra)
    if layers is not None:
        keep = getattr(model, "keep_layers", None)
        if keep is None:
            raise UnsupportedModelError(
                f"model family {family.architecture}: {model_cls.__name__} cannot run a range of its layers (no "
                "keep_layers / forward_stage); use pipeline_parallel_size: 1"
            )
        keep(*layers)
    weights = iterate_weights(files, allow_pickle=allow_pickle)
    if quant is not None and hasattr(quant, "checkpoint_weights"):  # a layer's parts gathered into one packed tensor
        weights = quant.checkpoint_weights(weights, quantization_config(model_dir))
    head: dict[str, object] = {}
    if quant is not None and getattr(quant, "quantizes_lm_head", False) and tp is None:
        weights = _remember(weights, ("lm_head.weight", "model.embed_tokens.weight"), head)
    load_weights(model, weights, source=str(model_dir))
    if head:
        _quantize_lm_head(model, quant, head.get("lm_head.weight", head.get("model.embed_tokens.weight") if config.tie_word_embeddings else None))
    use_cpu_matvec_layout(model)  # one-token steps stream float32 CPU weights faster column by column
    prepack_cpu_weights(model)  # (after it: a pack is of the weight's storage as it will be multiplied)
    return model.eval(), config


def _remember(weights: Iterable[tuple[str, object]], names: tuple[str, ...], seen: dict[str, object]) -> Iterator[tuple[str, object]]:
    """``weights`` passed through, the tensors named ``names`` kept in ``seen`` as read."""
    for name, tensor in weights:
        if name in names:
            seen[name] = tensor
        yield name, tensor


def _quantize_lm_head(model: nn.Module, quant: "QuantizationMethod", loaded: object) -> None:
    """The model's LM head multiplied by ``quant.lm_head(loaded)`` when the method offers a layer for it."""
    from corerun.models.layers import LMHead

    head = getattr(model, "lm_head", None)
    if loaded is None or type(head) is not LMHead or tuple(loaded.shape) != tuple(head.weight.shape):  # type: ignore[attr-defined]
        return
    head.quantized = quant.lm_head(loaded)


def find_weight_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files to read, by the rules in this module's docstring (a folder corerun made for a
    ``.gguf`` file: that file)."""
    gguf = gguf_file_of(model_dir)
    if gguf is not None:
        return [gguf]
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return _files_from_index(index, suffix=".safetensors")
    if (model_dir / "model.safetensors").is_file():
        return [_inside(model_dir, "model.safetensors", model_dir.name)]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return [_inside(model_dir, f.name, model_dir.name) for f in files]
    pickles = sorted(model_dir.glob("pytorch_model*.bin"))
    if pickles:
        if not allow_pickle:
            raise ModelLoadError(
                f"model folder {model_dir} has only pickle weights ({', '.join(p.name for p in pickles)}); corerun "
                "loads safetensors by default because unpickling a file can run code. Convert them to safetensors, "
                "or allow pickle weights (allow_pickle_weights: true in the config, allow_pickle=True in Python) "
                "if you trust the file"
            )
        pickle_index = model_dir / PICKLE_INDEX
        if pickle_index.is_file():
            return _files_from_index(pickle_index, suffix=None)
        return [_inside(model_dir, p.name, model_dir.name) for p in pickles]
    hint = ""
    if any(model_dir.glob("*.gguf")):
        hint = "; GGUF files are read by transformers (from_pretrained(folder, gguf_file=...)), then save_pretrained"
    raise ModelLoadError(
        f"model folder {model_dir} has no weights: expected model.safetensors, or {SAFETENSORS_INDEX} and the "
        f"shards it names (found: {folder_listing(model_dir)}){hint}"
    )


def _files_from_index(index: Path, suffix: str | None) -> list[Path]:
    """The shards ``index`` names, each checked: a file name (``suffix`` when given) inside the folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is not a valid weight index (needs a 'weight_map' object of file names): {exc}") from None
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ModelLoadError(f"{index}: weight_map values must be shard file names, got {bad[0]!r}")
    if suffix is not None:
        wrong = [n for n in names if not n.endswith(suffix)]
        if wrong:
            raise ModelLoadError(
                f"{index} names {wrong[0]!r}, which is not a {suffix} file; this index may name only {suffix} shards "
                "(pickle weights load only with allow_pickle_weights: true, from their own pytorch_model.bin.index.json)"
            )
    files = [_inside(index.parent, name, index.name) for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index.name} in {index.parent} names shards that are missing: {', '.join(missing)}")
    return files


def _inside(folder: Path, name: str, named_by: str) -> Path:
    """``folder / name``, refused (naming ``named_by``) unless it resolves, symlinks followed, inside ``folder``.

    A link into a Hugging Face hub cache's ``blobs/`` (``models--x/snapshots/<rev>/f -> ../../blobs/<sha>``)
    is inside the same cached repository and allowed.
    """
    root = folder.resolve()
    path = folder / name
    target = path.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if Path(name).is_absolute() or not any(target.is_relative_to(a) for a in allowed):
        raise ModelLoadError(
            f"{named_by} names weight file {name!r}, which resolves to {target}, outside the model folder {root}; "
            "weights load only from inside the model folder"
        )
    return path


def iterate_weights(files: Iterable[Path], allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in ``files``, on CPU in the stored dtype, one file open at a time.

    A file that is not ``.safetensors`` is unpickled only with ``allow_pickle``.
    """
    for path in files:
        if path.suffix == ".safetensors":
            yield from _safetensors(path)
        elif path.suffix == ".gguf":
            yield from gguf_weights(path)
        elif not allow_pickle:
            raise ModelLoadError(
                f"{path}: not a safetensors file, and pickle weights are not allowed (unpickling can run code); "
                "convert it to safetensors, or set allow_pickle_weights: true if you trust it"
            )
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # weights_only refuses arbitrary objects: a tampered or non-tensor file
                raise ModelLoadError(
                    f"{path}: cannot be loaded as plain tensors with torch.load(weights_only=True): "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; convert it to safetensors"
                ) from None
            yield from state.items()
            del state


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                yield name, f.get_tensor(name)
    except ModelLoadError:
        raise
    except Exception as exc:  # truncated or corrupt: safetensors' own errors name no file
        raise ModelLoadError(
            f"{path}: cannot read it as safetensors ({type(exc).__name__}: {str(exc)[:200]}); the file is "
            "truncated or corrupt, download it again"
        ) from None


def check_size_against_weights(config: ModelConfig, files: list[Path], model_dir: Path, quantized: bool = False) -> None:
    """Refuse a ``config.json`` whose model cannot be in these weight files (before allocating it).

    A lower bound of the parameter count (embeddings, attention and MLP projections), at 1 byte each
    (``quantized``: 2 bits each; 4-bit GPTQ / AWQ weights take half a byte), must fit in the files'
    total size. (Pickle weights are checked by their loader: a pickle's size says little before it is read.)
    """
    if any(f.suffix != ".safetensors" for f in files):
        return
    h, L = config.hidden_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (2 * q + 2 * kv) + 3 * h * config.intermediate_size
    params = config.vocab_size * h + L * per_layer
    size = sum(f.stat().st_size for f in files)
    if (params // 4 if quantized else params) > size:
        raise ModelLoadError(
            f"{model_dir / 'config.json'} describes a model of at least {params:,} parameters ({L:,} layers, "
            f"hidden_size {h:,}, vocab_size {config.vocab_size:,}), but the weight files hold only {size:,} bytes: "
            "config.json does not describe these weights"
        )


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
    """Fill ``model``'s parameters from checkpoint ``(name, tensor)`` pairs through their ``weight_loader``s.

    Raises :class:`ModelLoadError` listing every shape mismatch, unexpected and missing weight.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    loaded: set[tuple[int, Hashable]] = set()
    mismatched: list[str] = []
    unexpected: list[str] = []
    dropped: tuple[str, ...] = getattr(model, "dropped_weights", ())  # another pipeline stage's (keep_layers)
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (dropped and name.startswith(dropped)):
            continue
        target, shard = _target_name(name, packed)
        param = params.get(target)
        if param is None:
            unexpected.append(f"{name} {tuple(tensor.shape)}")
            continue
        try:
            param.weight_loader(param, tensor, shard)
        except WeightShapeError as exc:
            where = target if shard is None else f"{target} (shard {shard!r})"
            mismatched.append(f"{name} -> {where}: corerun expects {exc.expected}, the checkpoint has {exc.got}")
        # a mis-shaped weight is reported as such, not again as missing
        loaded.add((id(param), shard))
    missing = _missing(model, loaded, packed)
    if mismatched or unexpected or missing:
        raise ModelLoadError(_problems(model, source, mismatched, unexpected, missing))


def _target_name(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, Hashable]:
    for ckpt_module, (module, shard) in packed.items():
        part = f".{ckpt_module}."
        if part in name:
            return name.replace(part, f".{module}."), shard
    return name, None


def _missing(model: nn.Module, loaded: set[tuple[int, Hashable]], packed: dict[str, tuple[str, str]]) -> list[str]:
    """Checkpoint names of every parameter (shard) not loaded; a tied parameter counts once, under its first name."""
    missing = []
    for name, param in model.named_parameters():
        for shard in getattr(param, "shard_ids", (None,)):
            if (id(param), shard) not in loaded:
                missing.append(_checkpoint_name(name, shard, packed))
    return missing


def _checkpoint_name(name: str, shard: Hashable, packed: dict[str, tuple[str, str]]) -> str:
    for ckpt_module, (module, packed_shard) in packed.items():
        if packed_shard == shard and f".{module}." in name:
            return name.replace(f".{module}.", f".{ckpt_module}.")
    return name if shard is None else f"{name} (shard {shard!r})"


def _problems(model: nn.Module, source: str, mismatched: list[str], unexpected: list[str], missing: list[str]) -> str:
    lines = [f"cannot load the weights in {source} into {type(model).__name__}:"]
    for title, names in (("shape mismatches", mismatched), ("unexpected weights", unexpected), ("missing weights", missing)):
        if names:
            lines.append(f"  {title} ({len(names)}):")
            lines += [f"    {n}" for n in names[:_SHOWN]]
            if len(names) > _SHOWN:
                lines.append(f"    ... and {len(names) - _SHOWN} more")
    lines.append("  does config.json (architectures, sizes, tie_word_embeddings) describe these weights?")
    return "\n".join(lines)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
