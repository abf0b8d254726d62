"""`describe_blas()`: the BLAS that MLX's CPU matmuls call in this process, asked from the
dynamic loader and the library itself. Standard library only."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys

from ..kernels.gemv_forward import ENV_SKIPPED, is_forward_library
from ..runtime.switches import startup_value, thread_count
from .libraries import (ENV_CHOICE, FAST_KINDS, FORCED_CORE, INSTALL_HINT, OPT_OUT, THREAD_VARS,
                        blas_kind, candidate_paths, preloaded_libraries)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _global_cblas_provider() -> str | None:
    """Library that provides `cblas_sgemm` in the global scope (LD_PRELOAD or the program).

    The loader searches the global scope before a dlopen'ed module's own dependencies, so
    when this is set it is what libmlx.so calls, whatever libblas libmlx.so links.
    """
    try:
        main = ctypes.CDLL(None)
        if not hasattr(main, "cblas_sgemm"):
            return None
        addr = ctypes.cast(main.cblas_sgemm, ctypes.c_void_p)
        dladdr = getattr(main, "dladdr", None) or ctypes.CDLL("libdl.so.2").dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (OSError, AttributeError):
        pass
    return None


def mapped_blas_libraries() -> list[str]:
    """BLAS-like shared libraries mapped in this process, from /proc/self/maps."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and path not in found and blas_kind(path):
                    found.append(path)
    except OSError:
        pass
    return found


def _library_threads(path: str, kind: str) -> tuple[int | None, str | None, str | None]:
    """(threads, threading model, version) asked from a loaded library itself. OpenBLAS's
    threading model names the kernels it picked for this CPU too ("pthreads, Cooperlake
    kernels"): its DYNAMIC_ARCH build chooses them by CPUID, or as OPENBLAS_CORETYPE
    forces, and prefill's products run on them."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None, None, None
    if kind == "openblas" and hasattr(lib, "openblas_get_num_threads"):
        parallel = {0: "serial", 1: "pthreads", 2: "OpenMP"}.get(lib.openblas_get_parallel())
        version = None
        if hasattr(lib, "openblas_get_config"):
            lib.openblas_get_config.restype = ctypes.c_char_p
            config = (lib.openblas_get_config() or b"").decode(errors="replace").split()
            version = config[1] if len(config) > 1 else None
        if parallel and hasattr(lib, "openblas_get_corename"):
            lib.openblas_get_corename.restype = ctypes.c_char_p
            core = (lib.openblas_get_corename() or b"").decode(errors="replace").strip()
            parallel += f", {core} kernels" if core else ""
            if core and os.environ.get(FORCED_CORE):
                parallel += f" forced by {FORCED_CORE}"
        return lib.openblas_get_num_threads(), parallel, version
    if kind == "mkl" and hasattr(lib, "MKL_Get_Max_Threads"):
        return lib.MKL_Get_Max_Threads(), None, None
    if kind == "blis" and hasattr(lib, "bli_thread_get_num_threads"):
        return lib.bli_thread_get_num_threads(), None, None
    return None, None, None


_NAMES = {"openblas": "OpenBLAS", "mkl": "Intel MKL", "blis": "BLIS", "atlas": "ATLAS",
          "reference": "reference netlib"}


def describe_blas() -> dict:
    """The BLAS that MLX's CPU matmuls call in this process, for a start-up log line.

    Returns a dict with `kind` (openblas, mkl, blis, reference, accelerate, unknown), `name`,
    `path`, `threads`, `fast`, `source` ("LD_PRELOAD", "linked", or "not loaded yet" when
    MLX has not been imported), `mapped` (all BLAS-like libraries mapped), `gemv_forward`
    (whether gemv_forward.c takes the matrix-vector products), `gemv_forward_skipped`
    (why not, where the re-exec wanted it and its build failed) and `line` (also under
    `summary`), e.g. "BLAS: OpenBLAS 0.3.21 (pthreads) /usr/lib/.../libopenblas.so.0,
    1 thread per rank, matrix-vector products through sgemv" or "BLAS: reference netlib
    (slow: apt-get install libopenblas0-pthread)".
    """
    if sys.platform == "darwin":
        return {"kind": "accelerate", "name": "Apple Accelerate", "path": None, "threads": None,
                "fast": True, "source": "linked", "mapped": [], "gemv_forward": False,
                "gemv_forward_skipped": None, "line": "BLAS: Apple Accelerate",
                "summary": "BLAS: Apple Accelerate"}
    mapped = mapped_blas_libraries()
    path, source, forward = _serving_library(mapped)
    kind = (blas_kind(path) if path else None) or "unknown"
    threads, name = _threads_and_name(path, kind, mapped)
    fast = kind in FAST_KINDS
    # the re-exec wanted the forward and says why it did not build (gemv_forward.py)
    skipped = None if forward or not fast else os.environ.get(ENV_SKIPPED) or None
    line = _summary_line(kind, name, path, threads, forward, skipped)
    return {"kind": kind, "name": name, "path": path, "threads": threads, "fast": fast,
            "source": source, "mapped": mapped, "gemv_forward": forward,
            "gemv_forward_skipped": skipped, "line": line, "summary": line}


def _serving_library(mapped: list[str]) -> tuple[str | None, str, bool]:
    """(path, source, whether gemv_forward.c answers first) of the library MLX's
    ``cblas_sgemm`` calls: the global scope's provider, else the BLAS mapped, else (MLX
    not imported yet) the one a preload or MLX's wheel will bring."""
    path = _global_cblas_provider()
    forward = is_forward_library(path)
    if forward:  # gemv_forward.c answers first and calls the next preloaded library
        path = next((p for p in preloaded_libraries() if blas_kind(p) in FAST_KINDS), None)
    if path is not None:
        return path, "LD_PRELOAD", forward
    linked = [p for p in mapped if blas_kind(p) not in ("numpy-private", None)]
    if linked:
        return linked[0], "linked", forward
    preload = [p for p in preloaded_libraries() if blas_kind(p) in FAST_KINDS]
    bundled = []
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        bundled += sorted(glob.glob(os.path.join(os.path.dirname(root), "mlx*.libs",
                                                 "libblas*.so*")))
    return (preload or bundled or [None])[0], "not loaded yet", forward


def _threads_and_name(path: str | None, kind: str, mapped: list[str]) -> tuple[int | None, str]:
    """The library's thread count (asked from it where loaded, else from the environment)
    and its display name with version and threading model where it says them."""
    loaded = path and os.path.realpath(path) in {os.path.realpath(m) for m in mapped}
    threads, parallel, version = _library_threads(path, kind) if loaded else (None, None, None)
    if kind == "reference":
        threads = 1
    elif threads is None:
        threads = thread_count(THREAD_VARS.get(kind, ()))
    name = _NAMES.get(kind, "unknown BLAS")
    if parallel:
        name += f" {version} ({parallel})" if version else f" ({parallel})"
    return threads, name


def _summary_line(kind: str, name: str, path: str | None, threads: int | None,
                  forward: bool, skipped: str | None) -> str:
    """The start-up log line: a fast BLAS with its threads and whether the sgemv forward
    takes the matrix-vector products (or why it was wanted and is missing); the
    reference BLAS with why it is used."""
    if kind in FAST_KINDS:
        count = f"{threads} thread{'s' if threads != 1 else ''} per rank" if threads else ""
        line = f"BLAS: {name} {path}" + (f", {count}" if count else "")
        if forward:
            return line + ", matrix-vector products through sgemv"
        if skipped:
            return line + f" (no sgemv forward: {skipped})"
        return line
    if kind == "reference":
        if startup_value(ENV_CHOICE).lower() in OPT_OUT:
            why = f"slow: {ENV_CHOICE}={startup_value(ENV_CHOICE)}"
        elif candidate_paths():
            why = f"slow: spmd_cp.blas.ensure_fast_blas() would preload {candidate_paths()[0]}"
        else:
            why = f"slow: {INSTALL_HINT}"
        return f"BLAS: {name} ({why})"
    return f"BLAS: {name} {path or ''}".rstrip()
