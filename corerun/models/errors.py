"""Errors raised while reading a model folder: each names the folder or file, what was wrong, and what would be right."""

from __future__ import annotations

from pathlib import Path

from corerun.errors import CorerunError


class ModelLoadError(CorerunError, ValueError):
    """A model folder cannot be loaded: missing files, refused formats, missing / unexpected / mis-shaped weights."""


class UnsupportedModelError(ModelLoadError):
    """The folder is readable but describes something corerun does not run (architecture, rope type, activation)."""


def folder_listing(folder: Path, limit: int = 12) -> str:
    """``"a.json, b.bin, ... 3 more"``: what a folder holds, for error messages."""
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "nothing, the folder is empty"
    more = f", ... {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
