"""A rank's memory allocator: jemalloc where it is installed, preloaded with the BLAS.

MLX's CPU backend allocates on the Python thread and frees on its compute thread: every
graph node's output buffer, the set of buffers the node keeps alive and the task it hands
over are ``malloc`` calls, about 20 a node and 48,000 a decode step of SmolLM2-135M.
glibc's malloc takes a block freed by another thread back through its arena's lock and
slow paths (7.7% of a rank's samples at N = 2 on the 2-core test machine); jemalloc's
per-thread caches return such blocks to their arena in batches. Side by side on that
machine (docs/CPU_SPEED.md, "The allocator"): decode 4-5% faster at N = 1 and 7-9% at
N = 2 (where each rank's two threads share a core, so the allocator's time adds to the
step), prefill as fast, peak resident memory 11-12% higher (jemalloc's size classes and
its huge pages).

What it starts with (``MALLOC_CONF``):
- ``dirty_decay_ms:-1,muzzy_decay_ms:-1``: freed pages stay with the process for its
  next use rather than go back to the kernel after jemalloc's default 10 s. With the
  default a 3K-token prefill at N = 2 ran 12% slower in a hand run (pages returned
  mid-prefill and faulted in again). Between phases, after loading and after a
  prefill, the CLI hands them back (``release_free_memory``): a phase's peak is not
  kept for the next one, nor counted as the process's own memory by the memory
  forecast.
- ``thp:always`` while huge pages are on (``SPMD_CP_HUGE_PAGES``): jemalloc's own
  ``madvise(MADV_HUGEPAGE)`` on its memory, what glibc's ``malloc.hugetlb`` does
  otherwise (decode at N = 1 8-10% slower without it; a 3K prefill 3-4% faster, an 8K
  one within 1%: docs/CPU_SPEED.md).

``LD_PRELOAD`` is read only when a program starts, so the library rides on the
re-execution that preloads the BLAS (blas/reexec.py), as huge_pages.py's tunables do: a
rank that is not re-executed keeps glibc's malloc. ``SPMD_CP_ALLOCATOR`` chooses:
``auto`` (the default: jemalloc where found), ``jemalloc`` (an error where none is
found), ``glibc``, or a path to a jemalloc library. An allocator the user preloads
(jemalloc, tcmalloc, mimalloc) and a ``MALLOC_CONF`` the user sets are kept. Standard
library only (this runs before MLX or MPI is loaded).
"""

from __future__ import annotations

import ctypes
import os

from ..errors import UserError
from . import huge_pages

ENV = "SPMD_CP_ALLOCATOR"  # "auto" (default), "jemalloc", "glibc" or a library's path
CHOICES = ("auto", "jemalloc", "glibc")
LIBRARY_NAMES = ("libjemalloc.so.2", "libjemalloc.so")
INSTALL_HINT = "apt-get install libjemalloc2"
CONF = "MALLOC_CONF"
RETAIN_FREED_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
HUGE_PAGES = "thp:always"
ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.<op>" acts on every arena


def find_jemalloc(dirs: list[str] | None = None) -> str | None:
    """The first jemalloc library in ``dirs`` (default: where distributions put
    libraries, as for the BLAS), or None."""
    if dirs is None:
        from ..blas.libraries import library_dirs
        dirs = library_dirs()
    for directory in dirs:
        for name in LIBRARY_NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def requested() -> str:
    """``SPMD_CP_ALLOCATOR``: "auto" (also when unset), "glibc", or the path of the
    jemalloc library to preload ("jemalloc": the one found). UserError, in one line, for
    anything else, a path that is no file, or "jemalloc" where none is installed."""
    raw = os.environ.get(ENV, "").strip()
    value = raw.lower() or "auto"
    if value in ("auto", "glibc"):
        return value
    if value == "jemalloc":
        path = find_jemalloc()
        if path is None:
            raise UserError(f"{ENV}=jemalloc: no {LIBRARY_NAMES[0]} found "
                            f"(install it: {INSTALL_HINT})")
        return path
    if os.sep in raw:
        if not os.path.isfile(raw):
            raise UserError(f"{ENV}={raw}: no such file")
        return raw
    raise UserError(f"{ENV}={raw!r}: expected one of {', '.join(CHOICES)} "
                    "or the path of a jemalloc library")


def users_allocator(environ=os.environ) -> str | None:
    """An allocator the user preloads (an ``LD_PRELOAD`` entry named like jemalloc,
    tcmalloc or mimalloc), or None."""
    for entry in environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "malloc" in os.path.basename(entry):
            return entry
    return None


def startup_choice(environ=os.environ) -> tuple[str | None, dict]:
    """(the jemalloc library to preload or None, the variables to start with) for a
    re-executed rank. None: glibc asked for, none installed, the user's own allocator
    preloaded, or a bad ``SPMD_CP_ALLOCATOR`` (every rank reports that as one line
    before the model loads: cli/steps.py)."""
    try:
        choice = requested()
    except UserError:
        return None, {}
    if choice == "glibc" or users_allocator(environ):
        return None, {}
    library = find_jemalloc() if choice == "auto" else choice
    if library is None:
        return None, {}
    if CONF in environ:
        return library, {}  # the user's settings stand
    try:
        huge = huge_pages.requested() == "on"
    except UserError:
        huge = False
    conf = RETAIN_FREED_PAGES + (f",{HUGE_PAGES}" if huge else "")
    return library, {CONF: conf}


def _mallctl():
    """jemalloc's ``mallctl`` where this process allocates with jemalloc (which exports
    it when it replaces malloc), else None."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (AttributeError, OSError):
        return None
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                        ctypes.c_void_p, ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    return mallctl


def release_free_memory() -> bool:
    """Hand the pages jemalloc keeps for reuse back to the kernel (every arena's
    ``purge``); True where it did. Called between phases (after loading, after a
    prefill): within a phase the kept pages save their faults, across phases they would
    hold the last phase's peak (a model's load-time copies, a prefill's score tiles)
    and count as the process's own memory in the memory forecast."""
    mallctl = _mallctl()
    if mallctl is None:
        return False
    return mallctl(f"arena.{ALL_ARENAS}.purge".encode(), None, None, None, 0) == 0


def jemalloc_version() -> str | None:
    """The version of the jemalloc this process allocates with ("5.3.0"), or None where
    malloc is another."""
    mallctl = _mallctl()
    if mallctl is None:
        return None
    version = ctypes.c_char_p()
    size = ctypes.c_size_t(ctypes.sizeof(version))
    if mallctl(b"version", ctypes.byref(version), ctypes.byref(size), None, 0) != 0:
        return "unknown version"
    return (version.value or b"").decode(errors="replace").split("-")[0]


def describe(environ=os.environ) -> str:
    """The allocator this process runs, e.g. "jemalloc 5.3.0" or "glibc malloc (not
    re-executed)" (the same on ranks set up alike: doctor compares it)."""
    version = jemalloc_version()
    if version is not None:
        return f"jemalloc {version}"
    own = users_allocator(environ)
    if own:
        return f"{os.path.basename(own)} (preloaded by the user)"
    value = environ.get(ENV, "").strip().lower()
    if value == "glibc":
        return f"glibc malloc ({ENV}=glibc)"
    if find_jemalloc() is None:
        return f"glibc malloc (no jemalloc: {INSTALL_HINT})"
    return "glibc malloc (not re-executed)"
