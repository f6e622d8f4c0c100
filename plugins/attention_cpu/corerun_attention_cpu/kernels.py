"""Building, loading and calling the C++ kernels (``csrc/paged_attention.cpp``, ``csrc/fused_ops.cpp``,
``csrc/prefill_amx.cpp``) through ctypes.

The sources are compiled once per machine with the C++ compiler found here (``$CXX``, else ``c++``,
``g++`` or ``clang++``) at ``-O3 -march=native`` with OpenMP, into corerun's cache folder
(``$CORERUN_CACHE_DIR/attention_cpu/<key>/``, see ``corerun.sdk.cache_dir``); the key hashes the
sources, the compiler's version, the flags and the CPU's feature flags, so an edit, another compiler
or another CPU builds anew and a cache folder shared between machines is never wrong.  The build
goes to a temporary file renamed into place, so concurrent first uses are safe.  A compiler without
OpenMP gets a single-threaded build.  No torch headers are involved: the library has a plain C ABI
and takes ``data_ptr()``s, so it is independent of the torch version; ctypes releases the GIL
during each call.

One OpenMP runtime in the process: where torch ships its own ``libgomp`` (``torch/lib``, as its
wheels do, under that name or a renamed one) the library is linked against that file (``-l:`` with an
rpath to it), so its parallel regions run on the thread pool torch's operators use, with the symbols
that runtime has, whatever the system's compiler brings.  Where torch's copy keeps the soname ``libgomp.so.1`` the
dynamic loader would share it anyway once torch is loaded; the link makes it so in any order, and
with a renamed copy, where the system's would otherwise be a second runtime.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("corerun_attention_cpu")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
SOURCES = (SOURCE, SOURCE.with_name("fused_ops.cpp"), SOURCE.with_name("prefill_amx.cpp"))  # one library
LIB_NAME = "libcorerun_attention_cpu.so"
ABI_VERSION = 4
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
OPENMP_FLAG = "-fopenmp"
BUILD_TIMEOUT_S = 300
COMPILERS = ("c++", "g++", "clang++")

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, list[str]] | None = None

_i64, _i32p, _vp = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p


def find_compiler() -> tuple[str | None, str | None]:
    """``(path, None)`` of the C++ compiler to use, or ``(None, why not)``."""
    chosen = os.environ.get("CXX")
    if chosen:
        path = shutil.which(chosen)
        return (path, None) if path else (None, f"$CXX={chosen!r} is not an executable on PATH")
    for name in COMPILERS:
        path = shutil.which(name)
        if path:
            return path, None
    return None, (
        "no C++ compiler found (looked for $CXX, " + ", ".join(COMPILERS) + "); install one "
        "(e.g. apt-get install g++) or keep attention: torch"
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (``/proc/cpuinfo``; empty where there is no such file)."""
    return frozenset(_cpu_flags().split()) if Path("/proc/cpuinfo").exists() else frozenset()


def build_dir() -> Path:
    from corerun.sdk import cache_dir

    return cache_dir() / "attention_cpu"


def openmp_flags() -> tuple[str, ...]:
    """``-fopenmp``, linked against torch's own ``libgomp`` where torch ships one (see the module's note)."""
    import torch

    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))  # libgomp.so.1, or a wheel's renamed copy (libgomp-<hash>.so.1)
    if found:
        return (OPENMP_FLAG, f"-L{lib}", f"-l:{found[0].name}", f"-Wl,-rpath,{lib}")
    return (OPENMP_FLAG,)


def _build_key(compiler: str, version: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES), compiler.encode(), version.encode(), " ".join(flags).encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile the source to ``target`` (atomically); ``None`` on success, else the compiler's complaint."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write to the build folder {target.parent} ({exc}); set CORERUN_CACHE_DIR to a writable folder"
    try:
        proc = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            return f"exit status {proc.returncode}: {tail}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_open() -> tuple[ctypes.CDLL | None, list[str]]:
    compiler, why = find_compiler()
    if compiler is None:
        return None, [str(why)]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, [f"the C++ compiler {compiler} does not run: {type(exc).__name__}: {exc}"]
    failures: list[str] = []
    for flags in ((*BASE_FLAGS, *openmp_flags()), BASE_FLAGS):  # without OpenMP: single-threaded, still in place
        target = build_dir() / _build_key(compiler, version, flags) / LIB_NAME
        if not target.is_file():
            logger.info("cpu attention: compiling %s with %s %s", SOURCE.name, compiler, " ".join(flags))
            problem = _compile(compiler, flags, target)
            if problem:
                failures.append(f"compiling {SOURCE.name} with {compiler} {' '.join(flags)} failed: {problem}")
                continue
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:
            failures.append(f"loading {target} failed: {exc}")
            continue
        if lib.corerun_cpu_abi_version() != ABI_VERSION:
            failures.append(f"{target} has ABI version {lib.corerun_cpu_abi_version()}, expected {ABI_VERSION}")
            continue
        if failures:
            logger.warning("cpu attention: built without OpenMP (single-threaded): %s", failures[0])
        _declare(lib)
        return lib, []
    return None, failures


def _declare(lib: ctypes.CDLL) -> None:
    lib.corerun_cpu_attention.restype = ctypes.c_int
    lib.corerun_cpu_attention.argtypes = [
        ctypes.c_int, _vp, _i64, _i64, _vp, _vp, _i64, _i64, _i64, _vp, _i64, _i64,
        _vp, _vp, _vp, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, ctypes.c_float,
        ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int, _vp,
    ]
    lib.corerun_cpu_write_kv.restype = ctypes.c_int
    lib.corerun_cpu_write_kv.argtypes = [
        _i64, _vp, _i64, _i64, _vp, _i64, _i64, _vp, _vp, _i64, _i64, _i64, _vp, _i64, _i64, _i64, _i64, _i64, _vp,
    ]
    lib.corerun_cpu_openmp.restype = ctypes.c_int
    lib.corerun_cpu_prefill_amx_available.restype = ctypes.c_int
    lib.corerun_cpu_prefill_amx.restype = ctypes.c_int
    lib.corerun_cpu_prefill_amx.argtypes = [  # csrc/prefill_amx.cpp
        _vp, _i64, _i64, _vp, _i64, _i64, _vp, _i64, _i64, _vp, _i64, _i64, _vp, _i64, _i64, _i64, _i64, _i64,
        ctypes.c_float, ctypes.c_int, _vp,
    ]
    for fn, args in (  # csrc/fused_ops.cpp
        (lib.corerun_cpu_rms_norm, [ctypes.c_int, _vp, _i64, _i64, _i64, _i64, _i64, _vp, ctypes.c_float, _vp, ctypes.c_int]),
        (lib.corerun_cpu_silu_and_mul, [ctypes.c_int, _vp, _i64, _i64, _i64, _vp, ctypes.c_int]),
        (lib.corerun_cpu_rotary, [ctypes.c_int, _vp, _i64, _i64, _i64, _i64, _i64, _vp, _vp, _vp, ctypes.c_int]),
    ):
        fn.restype, fn.argtypes = ctypes.c_int, args


def load() -> tuple[ctypes.CDLL | None, list[str]]:
    """``(library, [])``, or ``(None, reasons)`` when it cannot be built or loaded here.  Built at most once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_open()
        return _loaded


def reset() -> None:
    """Forget the loaded library, so the next :func:`load` looks again (tests)."""
    global _loaded
    with _lock:
        _loaded = None
