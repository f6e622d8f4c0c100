"""What ``run.sh`` needs before it starts, checked in seconds, reported in one line.

- every runtime dependency of corerun (``[project] dependencies`` of ``pyproject.toml``) and
  ``transformers`` (the GPU scripts write their random models with it) is installed at its minimum
  version, or has a wheel in the wheels folder (``benchmarks/gpu/wheels``: the device machine has no
  network; ``fetch_wheels.sh`` makes the folder, the run tool's ``carry`` brings it);
- what each carried wheel to install requires of other distributions (its ``Requires-Dist``, markers
  evaluated for this Python, extras left out) is installed at a version that fits, or carried too:
  wheels are installed ``--no-deps``, so pydantic's ``typing-extensions>=4.16.0`` against an image's
  older typing-extensions would otherwise only fail on first import;
- each wheel there is for this Python and this machine;
- pip can install (``pip`` importable, >= 21.3 for editable installs; site-packages writable or a
  user site; ``EXTERNALLY-MANAGED`` images are fine because ``run.sh`` sets
  ``PIP_BREAK_SYSTEM_PACKAGES=1``);
- setuptools >= 77 (the build backend of the five distributions: ``license = "Apache-2.0"``
  needs it) is installed or comes as a wheel;
- torch and triton are installed (the image provides them: they are not carried), and, unless
  ``--dry-run``, a CUDA device is visible.

Prints nothing but one line ``run.sh: cannot start: ...`` (exit status 3) when something is missing,
else one line ``preflight ok: ...``; writes ``preflight.json`` (and ``machine.txt`` on a GPU) to ``--out``.

``CORERUN_GPU_PRETEND="pydantic=,setuptools=70.3.0"`` answers "is it installed, which version" as an
image lacking pydantic and shipping setuptools 70.3.0 would: a rehearsal of a bare image on any machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare image: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "benchmarks" / "gpu" / "wheels"
PRETEND_ENV = "CORERUN_GPU_PRETEND"
SETUPTOOLS_MIN = "77"
PIP_MIN = "21.3"
FROM_IMAGE = ("torch", "triton")  # never carried: the image's CUDA build is the point of the run
EXTRA = ["transformers>=4.45"]  # random_llama.py writes the GPU scripts' models with it


def norm(name: str) -> str:
    """A distribution name as wheel file names and metadata compare it (PEP 503, ``_`` for ``-``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def version_tuple(text: str) -> tuple[int, ...]:
    """``"2.14.4"`` -> ``(2, 14, 4)``; stops at the first part that is not a number (``"77.0.0rc1"`` -> ``(77, 0)``)."""
    out = []
    for piece in text.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        out.append(int(m.group()))
        if m.group() != piece:
            break
    return tuple(out)


def at_least(version: str, minimum: str | None) -> bool:
    return minimum is None or version_tuple(version) >= version_tuple(minimum)


def requirements(pyproject: Path) -> list[tuple[str, str | None]]:
    """``(name, minimum or None)`` for each entry of ``[project] dependencies`` (read without tomllib)."""
    text = pyproject.read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    if block is None:
        raise ValueError(f"{pyproject}: no [project] dependencies list")
    return [parse_requirement(r) for r in re.findall(r"\"([^\"]+)\"", block.group(1))]


def parse_requirement(text: str) -> tuple[str, str | None]:
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:>=\s*([0-9][^,;\s]*))?", text)
    if m is None:
        raise ValueError(f"cannot read the requirement {text!r}")
    return m.group(1), m.group(2)


class Image:
    """What is installed for this interpreter (or what ``$CORERUN_GPU_PRETEND`` says is)."""

    def __init__(self) -> None:
        self.pretend: dict[str, str | None] = {}
        for item in filter(None, (s.strip() for s in os.environ.get(PRETEND_ENV, "").split(","))):
            name, _, version = item.partition("=")
            self.pretend[norm(name)] = version.strip() or None

    def version(self, dist: str) -> str | None:
        if norm(dist) in self.pretend:
            return self.pretend[norm(dist)]
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None


def wheel_files(folder: Path) -> dict[str, tuple[str, Path]]:
    """``{normalised name: (version, path)}`` of the wheels in ``folder`` (``name-version-...-tags.whl``)."""
    out: dict[str, tuple[str, Path]] = {}
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        parts = path.name[:-4].split("-")
        if len(parts) >= 5:
            out[norm(parts[0])] = (parts[1], path)
    return out


def wheel_requires(path: Path) -> list[Requirement]:
    """The ``Requires-Dist`` entries of a wheel that apply here: markers evaluated for this interpreter,
    extras left out.  Raises ``ValueError`` naming the wheel when its metadata cannot be read."""
    try:
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                raise ValueError(f"{len(names)} .dist-info/METADATA files, expected 1")
            text = wheel.read(names[0]).decode("utf-8")
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        raise ValueError(f"cannot read the metadata of {path.name} ({exc})") from None
    out = []
    for line in Parser().parsestr(text).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def fits(version: str, spec: SpecifierSet) -> bool:
    """``version`` satisfies ``spec`` (pre-releases count: an image may ship one; an unreadable version does not)."""
    try:
        return spec.contains(version, prereleases=True)
    except ValueError:  # packaging's InvalidVersion
        return False


def wheel_mismatch(path: Path) -> str | None:
    """Why the wheel cannot install on this interpreter and machine, or None."""
    python_tag, abi_tag, platform_tag = path.name[:-4].split("-")[-3:]
    major, minor = sys.version_info[:2]

    def fits(tag: str) -> bool:
        if tag in ("py3", f"py{major}{minor}", f"cp{major}{minor}"):
            return True
        # a stable-ABI wheel built for an older CPython 3 fits a newer one
        return abi_tag == "abi3" and tag.startswith(f"cp{major}") and tag[3:].isdigit() and int(tag[3:]) <= minor

    if not any(fits(t) for t in python_tag.split(".")):
        return f"{path.name} is for {python_tag}, this is Python {major}.{minor} (cp{major}{minor})"
    machine = platform.machine()
    if platform_tag != "any" and machine not in platform_tag:
        return f"{path.name} is for {platform_tag}, this machine is {machine}"
    return None


def check(args: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    """``(problems, notes, facts)``: each problem is one thing to carry or install; ``facts["install"]``
    lists the carried wheels to install (only those of distributions missing or too old here)."""
    image = Image()
    wheels = wheel_files(args.wheels)
    problems: list[str] = []
    notes: list[str] = []
    install: list[str] = []
    facts: dict = {"python": sys.version.split()[0], "executable": sys.executable,
                   "wheels": sorted(p.name for _, p in wheels.values()), "install": install}

    # dependencies: installed, or a wheel carried along, with what that wheel requires in turn
    needed = [(n, SpecifierSet(f">={m}" if m else ""), None)
              for n, m in requirements(ROOT / "pyproject.toml") + [parse_requirement(r) for r in EXTRA]
              if n not in FROM_IMAGE]
    missing: dict[str, tuple[str, SpecifierSet, list[str]]] = {}  # normalised name -> (name, spec, needed by)
    chosen: dict[str, str] = {}  # normalised name -> the version this run will have (installed or carried)
    labels: list[str] = []
    queue = list(needed)
    while queue:
        name, spec, needed_by = queue.pop(0)
        key = norm(name)
        if key in chosen and fits(chosen[key], spec):
            continue
        have = image.version(name)
        wheel = wheels.get(key)
        if key not in chosen and have is not None and fits(have, spec):
            chosen[key] = have
            continue
        if wheel is not None and fits(wheel[0], spec) and str(wheel[1]) not in install:
            chosen[key] = wheel[0]
            install.append(str(wheel[1]))
            try:
                queue += [(r.name, r.specifier, f"{name} {wheel[0]}") for r in wheel_requires(wheel[1])]
            except ValueError as exc:
                problems.append(f"{exc}: rerun fetch_wheels.sh")
            continue
        _, before, needers = missing.get(key, (name, SpecifierSet(""), []))
        missing[key] = (name, before & spec, needers + ([needed_by] if needed_by else []))
    for key, (name, spec, needers) in missing.items():
        have, wheel = image.version(name), wheels.get(key)
        found = [f"have {have}"] if have else []
        found += [f"carried {wheel[0]}"] if wheel is not None else []
        found += [f"needed by {', '.join(needers)}"] if needers else []
        labels.append(f"{name}{spec}" + (f" ({'; '.join(found)})" if found else ""))
    if labels:
        problems.append(
            f"missing {', '.join(labels)}: no wheel for them in {_rel(args.wheels)}; make it with "
            f"`bash benchmarks/gpu/fetch_wheels.sh` on a machine with network and name "
            f"{_rel(args.wheels)} in the run tool's carry list"
        )
    for _, path in wheels.values():
        why = wheel_mismatch(path)
        if why:
            problems.append(f"{why}: rerun fetch_wheels.sh for this Python and machine")

    # pip and setuptools
    pip = image.version("pip")
    if pip is None or (norm("pip") not in image.pretend and importlib.util.find_spec("pip") is None):
        problems.append(f"pip is not installed for {sys.executable}: the image needs pip (python3 -m ensurepip)")
    elif not at_least(pip, PIP_MIN):
        problems.append(f"pip {pip} is older than {PIP_MIN} (editable installs): carry a pip wheel in {_rel(args.wheels)}")
    setuptools = image.version("setuptools")
    wheel = wheels.get("setuptools")
    if setuptools and at_least(setuptools, SETUPTOOLS_MIN):
        pass
    elif wheel and at_least(wheel[0], SETUPTOOLS_MIN):
        install.append(str(wheel[1]))
    else:
        problems.append(
            f"setuptools {setuptools or 'not installed'} is older than {SETUPTOOLS_MIN} (the pyproject files' "
            f"license field needs it) and {_rel(args.wheels)} has no setuptools>={SETUPTOOLS_MIN} wheel: "
            f"run fetch_wheels.sh and carry {_rel(args.wheels)}"
        )
    purelib = sysconfig.get_paths()["purelib"]
    marker = Path(sysconfig.get_paths()["stdlib"]) / "EXTERNALLY-MANAGED"
    if marker.exists():
        notes.append("this Python is marked externally managed; run.sh installs with PIP_BREAK_SYSTEM_PACKAGES=1")
    if not os.access(purelib, os.W_OK) and not _user_site_enabled():
        problems.append(f"cannot install: {purelib} is not writable and the user site is disabled (run as root or in a venv)")

    # what only the image provides
    for dist in FROM_IMAGE:
        v = image.version(dist)
        facts[dist] = v
        if v is None:
            problems.append(f"{dist} is not installed: the image must provide a CUDA build of it (it is not carried)")
    return problems, notes, facts


def _user_site_enabled() -> bool:
    import site

    return bool(site.ENABLE_USER_SITE) and sys.prefix == sys.base_prefix


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def cuda_facts() -> tuple[str | None, dict]:
    """(problem or None, facts) of the CUDA device, importing torch."""
    try:
        import torch
        import triton
    except Exception as exc:  # a broken CUDA build fails here, not in every part
        return f"importing torch and triton failed: {type(exc).__name__}: {exc}", {}

    facts = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__}
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False); use --dry-run on a machine without one", facts
    free, total = torch.cuda.mem_get_info()
    facts.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                 free_mib=free >> 20, total_mib=total >> 20)
    return None, facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wheels", type=Path, default=Path(os.environ.get("CORERUN_GPU_WHEELS") or WHEELS),
                   help="the carried wheels (default benchmarks/gpu/wheels, or $CORERUN_GPU_WHEELS)")
    p.add_argument("--dry-run", action="store_true", help="no CUDA device needed (the checks of what can be installed still run)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    problems, notes, facts = check(args)
    if not problems and not args.dry_run:
        problem, more = cuda_facts()
        facts.update(more)
        if problem:
            problems.append(problem)
        smi = _nvidia_smi()
        (args.out / "machine.txt").write_text(smi + "\n" + json.dumps(facts, indent=2) + "\n")
    doc = {"ok": not problems, "problems": problems, "notes": notes, "facts": facts, "dry_run": args.dry_run}
    (args.out / "preflight.json").write_text(json.dumps(doc, indent=2))
    (args.out / "install-wheels.txt").write_text("".join(f"{w}\n" for w in facts["install"]))
    if problems:
        print("run.sh: cannot start: " + "; ".join(problems), flush=True)
        return 3
    shown = {k: facts[k] for k in ("python", "torch", "triton", "device", "free_mib") if facts.get(k) is not None}
    wheels_note = f"; {len(facts['install'])} carried wheel(s) to install" if facts["install"] else ""
    print("preflight ok: " + ", ".join(f"{k} {v}" for k, v in shown.items()) + wheels_note + "".join(f"; {n}" for n in notes), flush=True)
    return 0


def _nvidia_smi() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version", "--format=csv"],
                              capture_output=True, text=True, timeout=10)
        return proc.stdout.strip() or proc.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {exc}"


if __name__ == "__main__":
    raise SystemExit(main())
