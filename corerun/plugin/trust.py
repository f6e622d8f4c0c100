"""Who ``auto`` may choose: built-ins, first-party plugin distributions, and certified plugins.

An installed package can register anything, so ``auto`` never picks an implementation that was not
shown to conform:

- **built-in**: registered by corerun's own ``corerun.plugin.builtin``;
- **first-party**: a distribution that corerun's own package metadata names as one of its extras
  (``pip install 'corerun[triton]'``).  They are released with corerun and run the conformance suite
  in its CI; another package cannot add itself to that list, because the list is corerun's metadata;
- **certified**: ``corerun conformance KIND:NAME`` passed on this machine for exactly the code that is
  installed now.  The certificate (a JSON file under ``$CORERUN_CACHE_DIR/certificates``, else
  ``$XDG_CACHE_HOME/corerun``, else ``~/.cache/corerun``) names what the run proved: a digest of the
  distribution's installed files (its wheel ``RECORD``; for an editable install, the files of its
  packages' source folders), the distribution's version, corerun's version and protocol version,
  torch's version and the device kind.  Any difference, and ``auto`` passes the implementation over
  saying which; a failing run of the suite revokes the certificate.

Any installed implementation can still be used by naming it (``attention: mine``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import importlib.util
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

from corerun._version import PROTOCOL_VERSION, __version__
from corerun.platform.host import cache_dir

BUILTIN, FIRST_PARTY, THIRD_PARTY = "built-in", "first-party", "third-party"
RANK = {BUILTIN: 2, FIRST_PARTY: 1, THIRD_PARTY: 0}  # who keeps a name registered twice
# what pip adds to a wheel's RECORD when it installs it: not part of the code
_INSTALLER_FILES = frozenset({"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"})


def normalize(distribution: str) -> str:
    """PEP 503 name normalisation: ``Corerun_Sampler.Basic`` -> ``corerun-sampler-basic``."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


@functools.lru_cache(maxsize=1)
def first_party_distributions() -> frozenset[str]:
    """The ``corerun-*`` distributions corerun's own metadata requires under an extra (normalised names);
    the libraries an extra pulls in (transformers, fastapi, ...) are not plugins and are not trusted as such."""
    try:
        requires = md.distribution("corerun").requires or []
    except md.PackageNotFoundError:
        return frozenset()
    names = set()
    for req in requires:
        if "extra ==" in req.replace("extra==", "extra =="):
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if match and normalize(match.group(1)).startswith("corerun-"):
                names.add(normalize(match.group(1)))
    return frozenset(names)


def origin(plugin: str, distribution: str) -> str:
    """``built-in``, ``first-party`` or ``third-party``."""
    if plugin == "corerun" and distribution == "corerun":
        return BUILTIN
    return FIRST_PARTY if normalize(distribution) in first_party_distributions() else THIRD_PARTY


# ------------------------------------------------------------ what a certificate names
def version_of(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``None`` when it is not installed)."""
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def device_kind(device_type: str) -> str:
    """The device a run happens on, as precisely as it changes a kernel's behaviour: ``cpu x86_64``,
    ``cuda NVIDIA H200 sm_90`` (the current CUDA device), or the bare type when nothing more is known."""
    if device_type == "cpu":
        return f"cpu {platform.machine() or 'unknown'}"
    if device_type == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                return f"cuda {torch.cuda.get_device_name()} sm_{major}{minor}"
        except Exception:  # a broken driver: the bare type, which no certificate from a working GPU matches
            pass
    return device_type


def _editable_root(dist: md.Distribution) -> str | None:
    """The source folder of an editable install (PEP 610 ``direct_url.json``), else ``None``."""
    try:
        doc = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return None
    if not doc.get("dir_info", {}).get("editable"):
        return None
    return str(doc.get("url", "")).removeprefix("file://") or None


def _top_level_names(dist: md.Distribution) -> list[str]:
    """The importable names a distribution provides: its corerun entry points' top packages, and
    ``top_level.txt`` when it has one."""
    names = [ep.value.split(":")[0].split(".")[0] for ep in dist.entry_points if ep.group == "corerun"]
    names += (dist.read_text("top_level.txt") or "").split()
    return sorted(set(n for n in names if n))


def _source_paths(names: list[str]) -> list[Path]:
    """The folders (or single module files) that importing ``names`` reads, found without importing them."""
    paths: list[Path] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            paths += [Path(p) for p in spec.submodule_search_locations]
        elif spec.origin and spec.origin not in ("built-in", "frozen"):
            paths.append(Path(spec.origin))
    return sorted(set(paths))


def _hash_tree(paths: list[Path]) -> str:
    """sha256 over every file under ``paths`` (relative name and content), leaving out bytecode caches."""
    digest = hashlib.sha256()
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo"):
                continue
            digest.update(f"{root.name}/{path.relative_to(root) if path != root else ''}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def installed_files(distribution: str) -> dict[str, str | None]:
    """``{"digest": sha256 hex or None, "from": what was hashed}`` for an installed distribution: the
    entries of its wheel ``RECORD`` (each file's own hash, as pip checked it on install), or for an
    editable install every file of its packages' source folders (the code changes there under a fixed
    version).  ``digest`` is ``None`` for a distribution that is not installed (registered in-process)."""
    try:
        dist = md.distribution(distribution)
    except md.PackageNotFoundError:
        return {"digest": None, "from": "not installed"}
    if _editable_root(dist) is not None:
        paths = _source_paths(_top_level_names(dist))
        if not paths:
            return {"digest": None, "from": f"editable install whose package folders were not found ({_editable_root(dist)})"}
        return {"digest": _hash_tree(paths), "from": "editable source " + ", ".join(map(str, paths))}
    record = dist.read_text("RECORD")
    if record is None:
        return {"digest": None, "from": "no RECORD"}
    entries = []
    for line in record.splitlines():
        path, _, rest = line.partition(",")
        file_hash = rest.partition(",")[0]
        if file_hash and not (".dist-info/" in path and path.rsplit("/", 1)[-1] in _INSTALLER_FILES):
            entries.append(f"{path},{file_hash}")
    return {"digest": hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest(), "from": "wheel RECORD"}


def fingerprint(registration: Any, device: str) -> dict[str, Any]:
    """What a certificate of ``registration`` on ``device`` (a device type) names, as installed now."""
    files = installed_files(registration.distribution)
    return {
        "distribution_version": registration.version,
        "files_digest": files["digest"],
        "files_from": files["from"],
        "corerun_version": __version__,
        "protocol_version": PROTOCOL_VERSION,
        "torch_version": version_of("torch"),
        "device_kind": device_kind(device),
    }


# what each fingerprint field is called when it differs
_FIELDS = {
    "distribution_version": "distribution version", "files_digest": "installed files",
    "corerun_version": "corerun version", "protocol_version": "protocol version",
    "torch_version": "torch version", "device_kind": "device",
}


# ------------------------------------------------------------ certificates
def certificate_path(kind: str, name: str, distribution: str, device: str) -> Path:
    return cache_dir() / "certificates" / f"{kind}-{name}-{normalize(distribution)}-{device}.json"


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_certificate(registration: Any, device: str, summary: dict[str, int]) -> Path:
    """Write the certificate of a passed, complete conformance run of ``registration`` on ``device``."""
    r = registration
    path = certificate_path(r.kind, r.name, r.distribution, device)
    doc = {
        "kind": r.kind, "name": r.name, "plugin": r.plugin, "distribution": r.distribution, "device": device,
        **fingerprint(r, device), "summary": summary, "date": _now(),
    }
    _write(path, doc)
    return path


def revoke_certificate(registration: Any, device: str, summary: dict[str, int]) -> Path | None:
    """Mark the certificate of ``registration`` on ``device`` revoked after a failing run (the path, or
    ``None`` when there was none): ``auto`` stops choosing it until a run passes again."""
    r = registration
    path = certificate_path(r.kind, r.name, r.distribution, device)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {"kind": r.kind, "name": r.name, "distribution": r.distribution, "device": device}
    doc["revoked"] = {"date": _now(), "failed": sum(n for k, n in summary.items() if k in ("failed", "error", "xpassed"))}
    _write(path, doc)
    return path


def certificate_problem(registration: Any, device: str) -> str | None:
    """``None`` when a certificate covers exactly the code installed now on ``device``; else why not."""
    r = registration
    path = certificate_path(r.kind, r.name, r.distribution, device)
    again = f"run `corerun conformance {r.kind}:{r.name}`"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return f"not certified on {device} ({again})"
    except (OSError, ValueError) as exc:
        return f"its certificate {path} is unreadable ({exc})"
    revoked = doc.get("revoked")
    if revoked:
        return (f"its certificate was revoked: `corerun conformance` failed {revoked.get('failed', '?')} check(s) "
                f"on {revoked.get('date', '?')}; fix it and {again} again")
    now = fingerprint(r, device)
    changed = []
    for key, title in _FIELDS.items():
        if doc.get(key) == now[key]:
            continue
        if key == "files_digest":
            was = (doc.get(key) or "none")[:12]
            changed.append(f"installed files changed since the run ({now['files_from']}: {was} -> {(now[key] or 'none')[:12]})")
        else:
            changed.append(f"{title} {doc.get(key)} -> {now[key]}")
    if changed:
        return f"its certificate is for other code ({'; '.join(changed)}); {again} again"
    return None
