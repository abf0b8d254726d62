"""`ensure_fast_blas()`: re-execute this process with an optimized BLAS in LD_PRELOAD.

LD_PRELOAD is read only when a program starts, so the process sets it and replaces itself
(`os.execv`: same pid, environment and file descriptors) before MLX or MPI is loaded.
Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import sys

from ..runtime import allocator, huge_pages
from ..runtime.switches import startup_value
from ..kernels.gemv_forward import ENV_SKIPPED, forward_library, wanted
from .libraries import (ENV_CHOICE, ENV_GUARD, FAST_KINDS, OPT_OUT, blas_kind, default_threads,
                        exports_cblas, find_fast_blas, mlx_bundles_fast_blas,
                        preloaded_libraries, thread_env)


def _mpi_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return bool(mpi and mpi.Is_initialized() and not mpi.Is_finalized())
    except Exception:
        return True  # be safe: never re-exec a process that may hold an MPI connection


def _default_argv() -> list[str] | None:
    """Interpreter arguments that restart this same program (None if it cannot be restarted)."""
    if sys.argv and sys.argv[0] in ("", "-"):
        return None  # interactive, or a script read from stdin that is gone now
    if getattr(sys, "frozen", False):
        return list(sys.argv[1:])
    # orig_argv (3.10+) keeps `-m pkg.mod`, `-c code`, `-u`, `-X ...`; for a console script it is
    # [python, /venv/bin/spmd-cp, args...], i.e. [python] + sys.argv.
    orig = getattr(sys, "orig_argv", None)
    return list(orig[1:]) if orig else list(sys.argv)


def _warn(msg: str) -> None:
    print(f"spmd-cp: {msg}", file=sys.stderr, flush=True)


def _resolve_choice() -> str | None:
    """The library SPMD_CP_BLAS asks for (or the best one found); None if none is usable."""
    choice = startup_value(ENV_CHOICE)
    if choice in ("", "auto"):
        return find_fast_blas()
    if choice in FAST_KINDS:
        path = find_fast_blas(choice)
        if path is None:
            _warn(f"{ENV_CHOICE}={choice}: no such library found; keeping the default BLAS")
        return path
    if not exports_cblas(choice):
        _warn(f"{ENV_CHOICE}={choice}: not a loadable library exporting cblas_sgemm; "
              "keeping the default BLAS")
        return None
    return choice


def _set_runtime_threads(path: str, threads: int) -> None:
    """Lower the thread count of an already loaded library (OpenBLAS, MKL, BLIS)."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return
    for setter in ("openblas_set_num_threads", "MKL_Set_Num_Threads", "bli_thread_set_num_threads"):
        if hasattr(lib, setter):
            getattr(lib, setter)(ctypes.c_int(threads))
            return


def ensure_fast_blas(argv: list[str] | None = None) -> str:
    """Make this process use an optimized BLAS, re-executing itself with LD_PRELOAD if needed.

    Does nothing on macOS, when MLX is missing or ships a fast BLAS, when SPMD_CP_BLAS is
    "reference", when no optimized BLAS is installed, or when MPI is already initialized.
    Otherwise sets LD_PRELOAD (prepended) and the library's thread count (default: usable
    cores // ranks on this node, unless the user set one) and calls os.execv: it does not return.

    Args:
        argv: arguments for the new interpreter (default: this process's original ones,
            `sys.orig_argv[1:]`; for a console script that equals `sys.argv`).

    Returns:
        Why nothing was (or needed to be) done: "not-linux", "no-mlx", "mlx-bundles-fast-blas",
        "opt-out", "active" (already preloaded), "not-found", "cannot-reexec".
    """
    if not sys.platform.startswith("linux"):
        return "not-linux"
    if startup_value(ENV_CHOICE).lower() in OPT_OUT:
        return "opt-out"
    if os.environ.get(ENV_GUARD) == str(os.getpid()):
        return "active"  # we are the re-executed process
    bundled = mlx_bundles_fast_blas()
    if bundled is None:
        return "no-mlx"
    if bundled:
        return "mlx-bundles-fast-blas"
    preloaded = [p for p in preloaded_libraries() if blas_kind(p) in FAST_KINDS]
    if preloaded:
        # The user preloaded one. Its threads were fixed at load time, but can still be lowered.
        env = thread_env(preloaded[0], default_threads())
        if env:
            os.environ.update(env)
            _set_runtime_threads(preloaded[0], default_threads())
        return "active"
    path = _resolve_choice()
    if path is None:
        return "not-found"
    args = _default_argv() if argv is None else list(argv)
    if args is None or not sys.executable:
        return "cannot-reexec"
    if _mpi_initialized():
        _warn("MPI is already initialized: cannot switch to a faster BLAS now "
              f"(call spmd_cp.blas.ensure_fast_blas() before importing mpi4py.MPI; {path})")
        return "cannot-reexec"
    _reexec_with(path, args)
    return "cannot-reexec"


# OpenBLAS's idle workers spin (sched_yield) for 2^OPENBLAS_THREAD_TIMEOUT cycles after each
# call before they sleep (default 2^28: about 0.1 s). Between prefill's calls that spin is
# short; in decode, whose own pool wants every core of the rank, a worker woken by a stray
# call spun beside it (Gemma 3 270M Q4_K_M, N = 1 on 2 threads: 11% of the run's samples in
# its sched_yield). At 2^4 cycles (OpenBLAS's least) it sleeps at once: decode 43.4 against
# 34.7 tok/s (1.25x; medians of 7 interleaved `generate --json` runs each, 300-token
# prompt, 64 tokens, 2-core AMD EPYC, 2026-11-29), the embedded SmolLM2 126.9 against
# 108.7 (1.17x, 3 runs each), prefill unchanged. A value the user set is kept.
OPENBLAS_IDLE_TIMEOUT = "4"


def _reexec_with(path: str, args: list[str]):
    """Preload ``path`` (behind the matrix-vector forward, gemv_forward.py, where it
    builds) and jemalloc where installed (runtime/allocator.py), and exec this
    interpreter again, with the allocator's huge-page advice for large blocks
    (runtime/huge_pages.py); returns only if exec fails."""
    saved = dict(os.environ)
    os.environ.update(thread_env(path, default_threads()))
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_IDLE_TIMEOUT)
    malloc, malloc_settings = allocator.startup_choice()
    os.environ.update(malloc_settings if malloc else huge_pages.startup_environment())
    forward, why_not = forward_library()
    os.environ.pop(ENV_SKIPPED, None)
    if forward is None and wanted():
        os.environ[ENV_SKIPPED] = why_not
    os.environ["LD_PRELOAD"] = " ".join(([malloc] if malloc else [])
                                        + ([forward] if forward else []) + [path]
                                        + preloaded_libraries())
    os.environ[ENV_GUARD] = str(os.getpid())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.execv(sys.executable, [sys.executable] + args)
    except OSError as e:
        os.environ.clear()
        os.environ.update(saved)
        _warn(f"re-exec with {path} failed ({e}); keeping the default BLAS")
