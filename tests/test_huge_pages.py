"""The KV cache on transparent huge pages: which bytes are advised, and that the kernel took the advice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from corerun.platform import host
from corerun.sdk.attention import zeros_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or absent here",
)


def _vma(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@needs_thp
def test_the_advice_covers_exactly_the_whole_huge_pages_inside_the_region() -> None:
    buf = torch.empty(9 << 20, dtype=torch.uint8)
    for skew in (0, 4096, 12345):  # the region's start, aligned or not
        start = buf.data_ptr() + skew
        nbytes = buf.numel() - skew - 777
        first = (start + (2 << 20) - 1) & ~((2 << 20) - 1)  # round up to 2 MiB
        last = (start + nbytes) & ~((2 << 20) - 1)  # round down
        assert host.advise_huge_pages(start, nbytes) == last - first > 0
    # a region holding no whole huge page is not advised
    inner = (buf.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)
    assert host.advise_huge_pages(inner + 4096, (2 << 20) - 8192) == 0


@needs_thp
def test_a_cpu_kv_cache_is_zero_and_eligible_for_huge_pages() -> None:
    shape = (2, 1536, 16, 3, 64)  # 36 MiB of float32, beyond glibc's largest heap allocation: fresh pages
    cache = zeros_kv_cache(shape, torch.float32, "cpu")
    assert cache.shape == shape and cache.dtype == torch.float32
    assert not cache.any()
    vma = _vma((cache.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1))  # the first whole huge page in it
    assert vma.get("THPeligible") == "1", vma
    assert "hg" in vma.get("VmFlags", "").split(), vma  # madvise(MADV_HUGEPAGE) recorded on the mapping


# ---------------------------------------------------------------- malloc: the memory a step frees is kept

FREED_SCRIPT = """
import ctypes, resource, sys, threading
import torch  # (as in the engine: torch loaded first, with its own thread)
from corerun.platform.host import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "keep" else "untouched")
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def touch():  # a step's activation: 24 MiB written, then freed
    p = libc.malloc(24 << 20)
    ctypes.memset(p, 1, 24 << 20)
    libc.free(p)
def faults(fn):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
touch()
again = faults(touch)  # the same thread's next step
other = []
th = threading.Thread(target=lambda: other.append(faults(touch)))  # the step thread's first step
th.start(); th.join()
print(again, other[0])
"""


def _freed(env: dict[str, str], keep: bool = True) -> tuple[str, int, int]:
    import os
    import subprocess

    run = subprocess.run([sys.executable, "-c", FREED_SCRIPT, "keep" if keep else "no"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env)
    assert run.returncode == 0, run.stderr
    kept, again, other = run.stdout.split()
    return kept, int(again), int(other)


needs_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not host._glibc(), reason="glibc's malloc only")


@needs_glibc
def test_the_memory_a_step_frees_is_served_again_on_its_thread_and_on_another() -> None:
    pages = (24 << 20) // 4096
    kept, again, other = _freed({})
    assert kept == "True" and again < pages // 10 and other < pages // 10, (again, other)
    # glibc left alone: the block goes back to the system and both steps fault it in page by page
    kept, again, other = _freed({}, keep=False)
    assert kept == "untouched" and again > pages * 9 // 10 and other > pages * 9 // 10, (again, other)


@needs_glibc
def test_a_users_own_malloc_settings_are_left_alone() -> None:
    for env in ({"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}):
        kept, _, _ = _freed(env)
        assert kept == "False", env


def test_a_cpu_runner_sets_malloc_before_its_weights_load(tmp_path, monkeypatch) -> None:
    from corerun.llm import LLM
    from corerun.models import loader
    from corerun.runner import construction
    from tests.helpers.tiny_models import make_tiny_model

    events: list[str] = []
    monkeypatch.setattr(construction, "keep_freed_memory", lambda: events.append("malloc") or True)
    real_load = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: events.append("weights") or real_load(*a, **k))
    LLM(model=str(make_tiny_model(tmp_path)), threads=1)
    assert events == ["malloc", "weights"]  # once, and before the weights: their memory comes after the setting
