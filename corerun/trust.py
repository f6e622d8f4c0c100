"""Who ``auto`` may choose: built-ins, first-party plugin distributions, and certified plugins.

An installed package can register anything, so ``auto`` never picks an implementation that was not
shown to conform:

- **built-in**: registered by corerun's own ``corerun.builtin_plugins``;
- **first-party**: a distribution that corerun's own package metadata names as one of its extras
  (``pip install 'corerun[triton]'``).  They are released with corerun and run the conformance suite
  in its CI; another package cannot add itself to that list, because the list is corerun's metadata;
- **certified**: ``corerun conformance KIND:NAME`` passed on this machine for exactly the installed
  distribution version, this corerun version and this device type; the certificate is a JSON file
  under ``$CORERUN_CACHE_DIR/certificates`` (else ``$XDG_CACHE_HOME/corerun``, else ``~/.cache/corerun``).
  Upgrading either side, or running on another device type, needs a new certificate.

Any installed implementation can still be used by naming it (``attention: mine``).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import json
import re
import time
from pathlib import Path
from typing import Any

from corerun._version import PROTOCOL_VERSION, __version__
from corerun.cache import cache_dir

BUILTIN, FIRST_PARTY, THIRD_PARTY = "built-in", "first-party", "third-party"
RANK = {BUILTIN: 2, FIRST_PARTY: 1, THIRD_PARTY: 0}  # who keeps a name registered twice


def normalize(distribution: str) -> str:
    """PEP 503 name normalisation: ``Corerun_Sampler.Basic`` -> ``corerun-sampler-basic``."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


@functools.lru_cache(maxsize=1)
def first_party_distributions() -> frozenset[str]:
    """The distributions corerun's own metadata requires under an extra (normalised names)."""
    try:
        requires = md.distribution("corerun").requires or []
    except md.PackageNotFoundError:
        return frozenset()
    names = set()
    for req in requires:
        if "extra ==" in req.replace("extra==", "extra =="):
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if match:
                names.add(normalize(match.group(1)))
    return frozenset(names)


def origin(plugin: str, distribution: str) -> str:
    """``built-in``, ``first-party`` or ``third-party``."""
    if plugin == "corerun" and distribution == "corerun":
        return BUILTIN
    return FIRST_PARTY if normalize(distribution) in first_party_distributions() else THIRD_PARTY


def certificate_path(kind: str, name: str, distribution: str, device: str) -> Path:
    return cache_dir() / "certificates" / f"{kind}-{name}-{normalize(distribution)}-{device}.json"


def record_certificate(registration: Any, device: str, summary: dict[str, int]) -> Path:
    """Write the certificate of a passed, complete conformance run of ``registration`` on ``device``."""
    r = registration
    path = certificate_path(r.kind, r.name, r.distribution, device)
    doc = {
        "kind": r.kind, "name": r.name, "plugin": r.plugin, "distribution": r.distribution,
        "distribution_version": r.version, "corerun_version": __version__, "protocol_version": PROTOCOL_VERSION,
        "device": device, "summary": summary, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def certificate_problem(registration: Any, device: str) -> str | None:
    """``None`` when a certificate covers exactly this installed version on ``device``; else why not."""
    r = registration
    path = certificate_path(r.kind, r.name, r.distribution, device)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return f"not certified on {device} (run `corerun conformance {r.kind}:{r.name}`)"
    except (OSError, ValueError) as exc:
        return f"its certificate {path} is unreadable ({exc})"
    want = {"distribution_version": r.version, "corerun_version": __version__, "protocol_version": PROTOCOL_VERSION}
    stale = [f"{k.replace('_', ' ')} {doc.get(k)} -> {v}" for k, v in want.items() if doc.get(k) != v]
    if stale:
        return f"its certificate is for another version ({'; '.join(stale)}); run `corerun conformance {r.kind}:{r.name}` again"
    return None
