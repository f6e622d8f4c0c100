"""Test support: run the ``flash`` backend on CPU against an EMULATOR of flash-attn (not flash-attn itself).

:func:`emulated` installs :mod:`.flash_attn_emulator` as the module ``flash_attn`` (FA2), or
:mod:`.flash_attn_interface_emulator` as ``flash_attn_interface`` (FA3, as on a Hopper GPU), and lets
:class:`~corerun_attention_flash.backend.FlashAttentionBackend` accept device ``cpu`` while it is active.
Everything is restored on exit.  The emulators ship in the package, rather than in its tests folder,
so that an installed ``corerun-attention-flash`` can be exercised by ``corerun.conformance`` on any
machine; the backend itself never imports this package.

What passes under ``emulated()`` shows that the backend hands flash-attn the right arguments for its
documented contract (cumulative lengths, block tables, cache lengths, scale, causal alignment, GQA);
it says nothing about the CUDA kernels.

Usage in a test::

    from corerun_attention_flash.testing import emulated

    with emulated() as flash:                           # FA2 API as `flash_attn`
        backend = flash.create(spec)                    # spec.device may be "cpu"
        ...                                             # parametrise over flash.capabilities
    with emulated("flash_attn_interface") as flash:     # FA3 API, as on a Hopper GPU
        ...

and, for ``corerun.conformance``, as an unregistered factory (a backend built under emulation keeps
calling the emulator after the context has exited)::

    from corerun.conformance import AttentionBackendSuite
    from corerun_attention_flash.testing import emulated_capabilities, emulated_factory

    class TestFlashEmulated(AttentionBackendSuite):
        implementation = "flash-fa2-emulated"
        factory = staticmethod(emulated_factory("flash_attn"))
        capabilities = emulated_capabilities()
        device = "cpu"

Not thread-safe: it swaps ``sys.modules`` entries and a module-level flag for the duration.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from corerun.sdk import AttentionCapabilities
from corerun.protocols.attention import AttentionSpec
from corerun_attention_flash import emulation
from corerun_attention_flash.backend import FlashAttentionBackend
from corerun_attention_flash.testing import flash_attn_emulator, flash_attn_interface_emulator

Library = Literal["flash_attn", "flash_attn_interface"]
_MODULES = ("flash_attn", "flash_attn_interface")


@dataclass(frozen=True)
class EmulatedFlash:
    """What :func:`emulated` yields."""

    library: Library
    module: ModuleType  # the emulator standing in for ``library``
    capabilities: AttentionCapabilities  # the declared ones, plus device "cpu" (and float64 when allowed)

    def create(self, spec: AttentionSpec, **options: Any) -> FlashAttentionBackend:
        return FlashAttentionBackend(spec, **options)


@contextmanager
def emulated(library: Library = "flash_attn", *, allow_float64: bool = False) -> Iterator[EmulatedFlash]:
    """Stand the emulator of ``library`` in for flash-attn and let the backend run on CPU, until exit.

    ``allow_float64`` also lets the backend and the emulator take float64 (real flash-attn never
    does), so tests can compare the plumbing against a float64 reference at ~1e-12.
    """
    if library not in _MODULES:
        raise ValueError(f"library must be one of {_MODULES}, got {library!r}")
    module = flash_attn_emulator if library == "flash_attn" else flash_attn_interface_emulator
    saved = {name: sys.modules.get(name, _MISSING) for name in _MODULES}
    saved_dtypes = set(flash_attn_emulator.ALLOWED_DTYPES)
    extra = frozenset({"float64"}) if allow_float64 else frozenset()
    previous = emulation.install(emulation.Emulation(hopper=library == "flash_attn_interface", extra_dtypes=extra))
    try:
        for name in _MODULES:  # the other name imports as missing (None in sys.modules -> ImportError)
            sys.modules[name] = module if name == library else None  # type: ignore[assignment]
        if allow_float64:
            flash_attn_emulator.ALLOWED_DTYPES.add(torch.float64)
        yield EmulatedFlash(library=library, module=module, capabilities=emulated_capabilities(allow_float64=allow_float64))
    finally:
        flash_attn_emulator.ALLOWED_DTYPES.clear()
        flash_attn_emulator.ALLOWED_DTYPES.update(saved_dtypes)
        emulation.install(previous)
        for name, entry in saved.items():
            if entry is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = entry


def emulated_capabilities(*, allow_float64: bool = False) -> AttentionCapabilities:
    """The declared capabilities plus device ``cpu`` (and float64): what the backend serves under :func:`emulated`."""
    caps = FlashAttentionBackend.capabilities
    extra = frozenset({"float64"}) if allow_float64 else frozenset()
    return dataclasses.replace(caps, devices=caps.devices | {"cpu"}, dtypes=caps.dtypes | extra)


def emulated_factory(library: Library = "flash_attn") -> Callable[..., FlashAttentionBackend]:
    """``factory(spec, **options)`` building the backend under ``emulated(library)``, for ``corerun.conformance``."""

    def create(spec: AttentionSpec, **options: Any) -> FlashAttentionBackend:
        with emulated(library) as flash:
            return flash.create(spec, **options)

    create.__name__ = f"flash_{library}_emulated"
    return create


_MISSING: Any = object()

__all__ = ["EmulatedFlash", "emulated", "emulated_capabilities", "emulated_factory", "flash_attn_emulator", "flash_attn_interface_emulator"]
