"""The host: its processors (read once from ``/proc/cpuinfo``), the ``threads`` setting, and the cache folder.

``threads: auto`` (the default) sizes torch's pool to the physical cores this process may run on
(hyper-threads share one core's vector units, so a second thread per core slows dense matmuls down
rather than up; tensor-parallel ranks on one host share the cores, so each of ``world_size`` ranks gets
its share), and then sizes each step (:func:`step_threads`): a step of fewer than
:data:`AUTO_PARALLEL_TOKENS` tokens (decodes, small batches, short prompts; in float32 fewer than
:data:`AUTO_PARALLEL_TOKENS_FLOAT32`) runs on one thread, a bigger one on all of them.  A small step's operators take tens of microseconds each, so the barrier
that ends every parallel operator costs more than the second thread gains, and on a loaded machine
it waits for a descheduled thread (docs/benchmarks.md has the measurements).  An integer ``threads``
is used for every step.  The engine applies the setting once at start (:func:`apply_threads`); the
runner keeps the two counts (:func:`step_pools`) and sets the pool of the thread that runs the forward
before each step whose count differs from it; the benchmark reports it.

:func:`prepare_openmp` (called when ``corerun`` is imported) asks the OpenMP runtime torch loads to
spin an idle thread for a short while (``GOMP_SPINCOUNT``, :data:`SPIN_COUNT`: a fraction of a millisecond)
before it sleeps: long enough to bridge the Python between one step's operators, whose next parallel
region then starts without waking a sleeping thread (on a virtual machine a wake-up took about 55 us
a region), short enough not to hold a core between steps.  GNU OpenMP keeps one pool of threads per
thread that starts parallel regions, and spins less (about 1,000 rounds) while it manages more threads
than there are processors: so a CPU runner's construction frees the constructing thread's pool when it is
done (:func:`release_openmp_threads`), and the thread that runs the steps holds the process's only pool.

``native_bfloat16()``: the CPU has bfloat16 dot-product instructions (AVX512_BF16, or AMX's bfloat16
tiles) and torch's oneDNN uses them.  There bfloat16 weights are multiplied at about twice to three
times the float32 rate with float32 accumulation (``dtype: bfloat16``); without them torch emulates
bfloat16 and it is slower than float32.  ``dtype: auto`` still picks float32 on CPU: why is in
docs/benchmarks.md.

Importing this module imports no torch; the functions that size or ask torch import it when called.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def processors(cpuinfo: str | None = None) -> list[dict[str, str]]:
    """One ``{field: value}`` per processor block of ``cpuinfo`` (``/proc/cpuinfo`` when ``None``).

    Empty where the file cannot be read; blocks without a ``processor`` field are left out.
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
    found = []
    for block in cpuinfo.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" in fields:
            found.append(fields)
    return found


def physical_cores(cpuinfo: str | None = None, allowed: set[int] | None = None) -> int:
    """Physical cores among the CPUs this process may use (``os.sched_getaffinity``).

    Counted as distinct ``(physical id, core id)`` pairs of the allowed processors; where the
    processors or those fields are missing, the allowed CPUs themselves.
    """
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = {
        (p.get("physical id", "0"), p["core id"])
        for p in processors(cpuinfo)
        if "core id" in p and int(p["processor"]) in allowed
    }
    return max(1, len(cores) if cores else len(allowed))


def _first_processor(cpuinfo: str | None) -> dict[str, str]:
    return next(iter(processors(cpuinfo)), {})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first processor (empty where there is no such field or file)."""
    return frozenset(_first_processor(cpuinfo).get("flags", "").split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The first processor's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``; empty where unknown)."""
    return _first_processor(cpuinfo).get("vendor_id", "")


@lru_cache(maxsize=1)
def native_bfloat16() -> bool:
    """The CPU multiplies bfloat16 natively (AVX512_BF16 or AMX-BF16) and torch's oneDNN has that path."""
    if not BF16_FLAGS & cpu_flags():
        return False
    import torch

    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


AUTO_PARALLEL_TOKENS = 512  # threads: auto runs steps of fewer tokens on one thread (docs/benchmarks.md)
# ... except in float32: a decode step on two threads took, against one, 1.06x the time at 1 request, 0.74x at 4,
# 0.70x at 8, 0.69x at 16 (an AMD EPYC, with the OpenMP pool and spin of prepare_openmp / release_openmp_threads;
# benchmarks/RESULTS.md, "Eighteenth session")
AUTO_PARALLEL_TOKENS_FLOAT32 = 4
# ... and bfloat16 on a CPU without AMX-BF16, whose products multiply on AVX512_BF16: 0.69x at 1 request, 0.75x
# at 4, 0.71x at 8, 0.65x at 16 (the same).  (The 512 above, for bfloat16 with AMX and other dtypes, was measured
# on a Sapphire Rapids before that OpenMP change, when every parallel region of a step paid a wake-up.)
AUTO_PARALLEL_TOKENS_BF16_NO_AMX = 1


def parallel_tokens(dtype: str, cpuinfo: str | None = None, products: int | None = None) -> int:
    """The step size in tokens from which ``threads: auto`` runs a step of a ``dtype`` model on every thread
    (on the CPU ``cpuinfo`` describes: this machine's by default).  ``products``: the size from which the
    model's quantization method says its products gain from every thread (its ``parallel_tokens``), where it
    says so; the smaller of the two is taken."""
    if dtype == "float32":
        rule = AUTO_PARALLEL_TOKENS_FLOAT32
    elif dtype == "bfloat16" and "amx_bf16" not in cpu_flags(cpuinfo):
        rule = AUTO_PARALLEL_TOKENS_BF16_NO_AMX
    else:
        rule = AUTO_PARALLEL_TOKENS
    return rule if products is None else max(1, min(rule, products))


WAIT_POLICY_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # a user's choice of wait policy wins
# rounds of GNU OpenMP's spin-wait (a PAUSE each) before an idle thread sleeps: about 0.2-0.6 ms.  One request's
# two-thread decode step, bfloat16, on an AMD EPYC VM: 21.7 ms under OMP_WAIT_POLICY=PASSIVE (every region a
# wake-up), 11.5 ms under this (docs/benchmarks.md, "CPU settings that matter")
SPIN_COUNT = 20000
_SET_BY_PREPARE: dict[str, str] = {}  # what prepare_openmp put into os.environ


def prepare_openmp() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` for the OpenMP runtime torch is about to load; ``True`` if it
    was set.

    OpenMP reads its environment once, when it loads (with torch), so this acts only before torch is
    imported and only where the environment names no wait policy (``OMP_WAIT_POLICY``,
    ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) of its own.
    """
    if "torch" in sys.modules or any(name in os.environ for name in WAIT_POLICY_ENV):
        return False
    os.environ["GOMP_SPINCOUNT"] = _SET_BY_PREPARE["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True


OMP_PAUSE_SOFT = 1  # omp_pause_resource_kind_t (OpenMP 5.0)


def release_openmp_threads() -> bool:
    """Free the OpenMP thread pool of the calling thread (``omp_pause_resource_all``: its idle threads exit);
    ``True`` if a runtime did.  Call it outside any parallel region, on a thread that is done with parallel
    work for now: a later region on it makes a new pool.  A CPU runner calls it last in its construction, so that the
    thread running the steps is the only one holding OpenMP threads (module docstring)."""
    import ctypes

    freed = False
    for path in openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # (already loaded: the same library)
        except (OSError, AttributeError):
            continue
        pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
        freed |= pause(OMP_PAUSE_SOFT) == 0
    return freed


def environment_for_others(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` (this process's environment) less what :func:`prepare_openmp` put into it, for a process started
    from this one: a peer engine started by ``corerun bench --compare`` then runs with its own OpenMP defaults, as
    its users run it (a corerun process sets the policy again when it imports corerun).  A value the user set is kept."""
    return {k: v for k, v in env.items() if _SET_BY_PREPARE.get(k) != v}


OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")  # GNU, Intel, LLVM


def openmp_runtimes(maps: str | None = None) -> list[str]:
    """The OpenMP runtime files mapped into this process (``/proc/self/maps``, or the ``maps`` text given).

    One is right: two runtimes in one process keep two thread pools that oversubscribe the cores and
    do not know of each other.  Empty where the file cannot be read (not Linux).
    """
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (absent for anonymous maps)
        path = fields[5].strip() if len(fields) == 6 else ""
        name = os.path.basename(path)
        if name.startswith(OPENMP_RUNTIMES) and ".so" in name:
            found.add(path)
    return sorted(found)


def resolve_threads(setting: int | str, world_size: int = 1) -> int:
    """The thread count for ``threads: setting`` (an integer, or ``"auto"``) in one of ``world_size`` ranks."""
    if setting == "auto":
        return max(1, physical_cores() // max(1, world_size))
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads must be an integer >= 1 or 'auto', got {setting!r}")
    return setting


def apply_threads(setting: int | str, world_size: int = 1) -> int:
    """Size torch's intra-op pool for ``threads: setting``; returns the thread count now in force.

    With ``auto`` the steps are then sized one by one (:func:`step_pools`).
    """
    import torch

    n = resolve_threads(setting, world_size)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def step_threads(num_tokens: int, threads: int, auto: bool, from_tokens: int = AUTO_PARALLEL_TOKENS) -> int:
    """The threads a step of ``num_tokens`` tokens runs on: all ``threads``, or one under ``auto`` for a step
    below ``from_tokens`` (:func:`parallel_tokens` of the model's dtype)."""
    return threads if not auto or num_tokens >= from_tokens else 1


def step_pools(threads: int, auto: bool) -> tuple[int, int]:
    """:func:`step_threads` of a small step and of a large one (below / from :func:`parallel_tokens`),
    computed once: the runner picks one per step by its token count and sets torch's pool when it differs."""
    return step_threads(1, threads, auto), step_threads(AUTO_PARALLEL_TOKENS, threads, auto)


MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to here come from the heap and are reused
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before any is returned


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep and share the memory a CPU step frees; ``True`` if it was set.

    A step of thousands of tokens allocates activations of tens of megabytes and frees them at its end.
    Left to itself, glibc gives each thread an arena of its own (the steps run on the engine's thread,
    not on the one whose warm-up touched that memory first), serves blocks over a moving threshold by
    ``mmap`` and gives them back on ``free``, so a step faults its memory in again, page by page.  Here:
    one arena for every thread, blocks up to 32 MiB from the heap, and 1 GiB of free memory kept at its
    top.  The first 4096-token step of a 32-request batch (bfloat16, one thread) then took 1-9 thousand
    page faults and 1274-1313 ms, against 43-56 thousand and 1378-1402 ms (benchmarks/RESULTS.md,
    "Twelfth session").  The cost is memory: the process keeps its largest step's activations once the
    step is over.

    Where the environment already chooses (``MALLOC_ARENA_MAX`` and the other ``MALLOC_*_`` variables,
    ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``, tcmalloc, jemalloc or mimalloc in ``LD_PRELOAD``),
    or the C library is not glibc, nothing is changed.
    """
    if any(name in os.environ for name in MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS) or not _glibc():
        return False
    libc = _libc()
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


@lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library this process runs on, loaded once, with ``madvise``'s argument types declared."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_HUGEPAGE = 14


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Ask Linux to back the whole 2 MiB pages inside ``[address, address + nbytes)`` with transparent
    huge pages (``madvise(MADV_HUGEPAGE)``); returns the bytes advised, 0 where it cannot (not Linux,
    THP off, a region under 2 MiB, the call refused).  Pages touched before the call stay as they are.

    For memory read in scattered pieces, like a paged KV cache: one TLB entry covers 2 MiB instead of
    4 KiB, so a decode walking thousands of blocks stops missing the TLB at almost every block.
    """
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    length = (address + nbytes - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0 or not sys.platform.startswith("linux") or not _huge_pages_allowed():
        return 0
    return length if _libc().madvise(start, length, MADV_HUGEPAGE) == 0 else 0


@lru_cache(maxsize=1)
def _huge_pages_allowed(setting: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> bool:
    try:
        return "[never]" not in setting.read_text()
    except OSError:
        return False


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: Any) -> Any:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, advised onto huge pages before the zeros touch it."""
    import torch

    out = torch.empty(shape, dtype=dtype)
    advise_huge_pages(out.data_ptr(), out.numel() * out.element_size())
    return out.zero_()


def cache_dir() -> Path:
    """Where corerun keeps what it makes once per machine (the converted default model, certificates of
    conformance runs, plugins' compiled kernels): ``$CORERUN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/corerun``, else ``~/.cache/corerun``."""
    if os.environ.get("CORERUN_CACHE_DIR"):
        return Path(os.environ["CORERUN_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "corerun"
    return Path.home() / ".cache" / "corerun"
