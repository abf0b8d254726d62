"""Run MLX's CPU matmuls on an optimized BLAS instead of the reference one (Linux).

The `mlx-cpu` wheel links netlib's *reference* BLAS (`mlx_cpu.libs/libblas-*.so`): a float32
2048^3 matmul runs at ~5 GFLOP/s on our 2-core x86 machines, against ~170 (one thread) to
~320 (two threads) with OpenBLAS. The dynamic loader lets a library named in `LD_PRELOAD`
provide `cblas_sgemm` & co. before the one libmlx.so links, but `LD_PRELOAD` is read only when
a program starts. So `ensure_fast_blas()` sets it and re-executes the same command line
(`os.execv`: same pid, same environment, same inherited file descriptors) before anything
heavy has happened. Call it first in the entry point: before `import mlx` (only to save the
work) and before `from mpi4py import MPI` (required: the re-exec must happen before
MPI_Init; under mpiexec the launcher's PMI connection is still untouched at that point).

    python -m spmd_cp.blas            # re-exec if useful, then print the BLAS in use
    SPMD_CP_BLAS=reference ...        # opt out: keep the reference BLAS
    SPMD_CP_BLAS=/path/libfoo.so ...  # use this library (it must export cblas_sgemm)
    SPMD_CP_BLAS=openblas|mkl|blis    # the first library of that family found

This module uses only the standard library: importing it does not load MLX or MPI.
On macOS it does nothing: MLX uses Accelerate there.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.metadata
import importlib.util
import os
import platform
import sys
import sysconfig

ENV_CHOICE = "SPMD_CP_BLAS"  # unset/"auto", "reference", a family name, or a library path
ENV_GUARD = "SPMD_CP_BLAS_REEXEC"  # pid of the process that re-executed itself
OPT_OUT = ("reference", "off", "none", "0")
INSTALL_HINT = "apt-get install libopenblas0-pthread"

# Launchers' "ranks on this node" variables: MPICH Hydra, Open MPI, MVAPICH, Cray PALS, Slurm.
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                   "PALS_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

# Variables each family reads for its thread count, in the library's own precedence order
# (OpenBLAS: OPENBLAS_NUM_THREADS > GOTO_NUM_THREADS > OMP_NUM_THREADS). If the user set any
# of them we leave the count alone.
THREAD_VARS = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
}
FAST_KINDS = tuple(THREAD_VARS)

# Where distributions put them, best first, relative to each library directory. The pthreads
# builds come before OpenMP ones (MLX does not use OpenMP; one runtime fewer), serial last.
_RELATIVE_CANDIDATES = (
    "openblas-pthread/libopenblas.so.0",  # Debian / Ubuntu libopenblas0-pthread
    "openblas-openmp/libopenblas.so.0",   # Debian / Ubuntu libopenblas0-openmp
    "libopenblasp.so.0",                  # Fedora / RHEL openblas-threads
    "libopenblas.so.0",                   # Debian alternative link, Arch, conda, source builds
    "libopenblaso.so.0",                  # Fedora / RHEL openblas-openmp
    "libopenblas.so",
    "blis-pthread/libblis.so.4", "blis-pthread/libblis.so.3",  # Debian libblis4-pthread
    "blis-openmp/libblis.so.4", "blis-openmp/libblis.so.3",
    "libblis-mt.so.4", "libblis.so.4", "libblis.so.3",
    "libmkl_rt.so.2", "libmkl_rt.so",     # conda / oneAPI MKL
    "openblas-serial/libopenblas.so.0",   # single-threaded, still ~30x the reference
)


def blas_kind(path: str) -> str | None:
    """Family of a BLAS library from its (resolved) path: openblas, mkl, blis, reference, ..."""
    real = os.path.realpath(path).lower()
    name = os.path.basename(real)
    if "scipy_openblas" in name:
        return "numpy-private"  # numpy's copy: every symbol is renamed (scipy_cblas_sgemm)
    for kind in ("mkl", "blis", "openblas", "atlas"):
        if kind in real:
            return kind
    if name.startswith(("libblas", "libcblas", "liblapack")):
        return "reference"
    return None


def _library_dirs() -> list[str]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/lib64", "/usr/lib",
            "/usr/local/lib", "/opt/OpenBLAS/lib", os.path.join(sys.prefix, "lib")]
    if os.environ.get("CONDA_PREFIX"):
        dirs.append(os.path.join(os.environ["CONDA_PREFIX"], "lib"))
    return dirs


def _mkl_wheel_libraries() -> list[str]:
    """libmkl_rt from PyPI's `mkl` wheel (installed as data files under <prefix>/lib)."""
    try:
        files = importlib.metadata.distribution("mkl").files or ()
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))


def candidate_paths() -> list[str]:
    """Existing files that may be an optimized BLAS, best first (not yet verified)."""
    seen, found = set(), []
    paths = [os.path.join(d, rel) for d in _library_dirs() for rel in _RELATIVE_CANDIDATES]
    for path in paths + _mkl_wheel_libraries():
        real = os.path.realpath(path)
        if os.path.isfile(real) and real not in seen and blas_kind(real) in FAST_KINDS:
            seen.add(real)
            found.append(path)
    return found


@functools.lru_cache(maxsize=None)
def exports_cblas(path: str) -> bool:
    """True if the library loads and exports the standard `cblas_sgemm` that MLX calls."""
    try:
        return hasattr(ctypes.CDLL(path), "cblas_sgemm")
    except OSError:
        return False


def find_fast_blas(kind: str | None = None) -> str | None:
    """Path of an optimized BLAS with standard cblas symbols on this machine, or None.

    Args:
        kind: only consider this family ("openblas", "mkl" or "blis").
    """
    for path in candidate_paths():
        if (kind is None or blas_kind(path) == kind) and exports_cblas(path):
            return path
    return None


def _mlx_bundles_fast_blas() -> bool | None:
    """None if MLX is not installed; True if its wheel carries an optimized BLAS itself."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        site = os.path.dirname(root)
        libs = glob.glob(os.path.join(root, "lib", "*.so*"))
        libs += glob.glob(os.path.join(site, "mlx*.libs", "*.so*"))
        if any(blas_kind(p) in FAST_KINDS for p in libs):
            return True
    return False


def usable_cpus() -> int:
    """CPUs this process may run on: affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def local_ranks() -> int:
    """Ranks the MPI launcher started on this node (1 outside a launcher)."""
    for var in LOCAL_SIZE_VARS:
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def default_threads() -> int:
    """BLAS threads per rank: the ranks on this node share its cores without oversubscribing."""
    return max(1, usable_cpus() // local_ranks())


def _thread_env(path: str, threads: int) -> dict:
    """The variables to set for `threads` BLAS threads, or {} if the user set any already."""
    kind = blas_kind(path)
    names = THREAD_VARS.get(kind, ())
    if not names or any(os.environ.get(v) for v in names):
        return {}
    env = {names[0]: str(threads)}
    if "openmp" in os.path.realpath(path) or os.path.basename(path).startswith("libopenblaso"):
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _preloaded() -> list[str]:
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]


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
    choice = os.environ.get(ENV_CHOICE, "").strip()
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
    if os.environ.get(ENV_CHOICE, "").strip().lower() in OPT_OUT:
        return "opt-out"
    if os.environ.get(ENV_GUARD) == str(os.getpid()):
        return "active"  # we are the re-executed process
    bundled = _mlx_bundles_fast_blas()
    if bundled is None:
        return "no-mlx"
    if bundled:
        return "mlx-bundles-fast-blas"
    preloaded = [p for p in _preloaded() if blas_kind(p) in FAST_KINDS]
    if preloaded:
        # The user preloaded one. Its threads were fixed at load time, but can still be lowered.
        env = _thread_env(preloaded[0], default_threads())
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
    saved = dict(os.environ)
    os.environ.update(_thread_env(path, default_threads()))
    os.environ["LD_PRELOAD"] = " ".join([path] + _preloaded())
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
    return "cannot-reexec"


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
    """(threads, threading model, version) asked from a loaded library itself."""
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
    MLX has not been imported), `mapped` (all BLAS-like libraries mapped) and `line` (also
    under `summary`), e.g. "BLAS: OpenBLAS 0.3.21 (pthreads) /usr/lib/.../libopenblas.so.0,
    1 thread per rank" or "BLAS: reference netlib (slow: apt-get install libopenblas0-pthread)".
    """
    if sys.platform == "darwin":
        return {"kind": "accelerate", "name": "Apple Accelerate", "path": None, "threads": None,
                "fast": True, "source": "linked", "mapped": [], "line": "BLAS: Apple Accelerate",
                "summary": "BLAS: Apple Accelerate"}
    mapped = mapped_blas_libraries()
    path, source = _global_cblas_provider(), "LD_PRELOAD"
    if path is None:
        source = "linked"
        linked = [p for p in mapped if blas_kind(p) not in ("numpy-private", None)]
        path = linked[0] if linked else None
    if path is None:
        source = "not loaded yet"
        preload = [p for p in _preloaded() if blas_kind(p) in FAST_KINDS]
        bundled = []
        spec = importlib.util.find_spec("mlx")
        for root in (spec.submodule_search_locations or []) if spec else []:
            bundled += sorted(glob.glob(os.path.join(os.path.dirname(root), "mlx*.libs",
                                                     "libblas*.so*")))
        path = (preload or bundled or [None])[0]
    kind = (blas_kind(path) if path else None) or "unknown"
    loaded = path and os.path.realpath(path) in {os.path.realpath(m) for m in mapped}
    threads, parallel, version = _library_threads(path, kind) if loaded else (None, None, None)
    if kind == "reference":
        threads = 1
    elif threads is None:
        var = next((v for v in THREAD_VARS.get(kind, ()) if os.environ.get(v)), None)
        threads = int(os.environ[var]) if var and os.environ[var].isdigit() else None
    name = _NAMES.get(kind, "unknown BLAS")
    if parallel:
        name += f" {version} ({parallel})" if version else f" ({parallel})"
    fast = kind in FAST_KINDS
    if fast:
        count = f"{threads} thread{'s' if threads != 1 else ''} per rank" if threads else ""
        line = f"BLAS: {name} {path}" + (f", {count}" if count else "")
    elif kind == "reference":
        if os.environ.get(ENV_CHOICE, "").strip().lower() in OPT_OUT:
            why = f"slow: {ENV_CHOICE}={os.environ[ENV_CHOICE]}"
        elif candidate_paths():
            why = f"slow: spmd_cp.blas.ensure_fast_blas() would preload {candidate_paths()[0]}"
        else:
            why = f"slow: {INSTALL_HINT}"
        line = f"BLAS: {name} ({why})"
    else:
        line = f"BLAS: {name} {path or ''}".rstrip()
    return {"kind": kind, "name": name, "path": path, "threads": threads, "fast": fast,
            "source": source, "mapped": mapped, "line": line, "summary": line}


def _self_check(argv: list[str]) -> None:
    """`python -m spmd_cp.blas [--json] [--matmul N]`: the BLAS in use and a matmul's speed."""
    import json
    import time

    ensure_fast_blas()
    import mlx.core as mx

    n = int(argv[argv.index("--matmul") + 1]) if "--matmul" in argv else 0
    info = describe_blas()
    if n:
        a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
        mx.eval(a @ b)
        start, reps = time.perf_counter(), 3
        for _ in range(reps):
            mx.eval(a @ b)
        info["matmul_gflops"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e9
        info["matmul_n"] = n
    info["pid"] = os.getpid()
    if "--json" in argv:
        print(json.dumps(info), flush=True)
    else:
        speed = f" ({info['matmul_gflops']:.1f} GFLOP/s at {n}^3 float32)" if n else ""
        print(info["line"] + speed, flush=True)


if __name__ == "__main__":
    _self_check(sys.argv[1:])
