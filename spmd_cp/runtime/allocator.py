"""A rank's memory allocator: glibc's malloc, or jemalloc on request, preloaded with the BLAS.

MLX's CPU backend allocates on the Python thread and frees on its compute thread: every
graph node's output buffer, the set of buffers the node keeps alive and the task it hands
over are ``malloc`` calls, about 20 a node and 48,000 a decode step of SmolLM2-135M.
glibc's malloc takes a block freed by another thread back through its arena's lock and
slow paths (7.7% of a rank's samples at N = 2 on the 2-core test machine); jemalloc's
per-thread caches return such blocks to their arena in batches.

``SPMD_CP_ALLOCATOR=jemalloc`` (or the path of a jemalloc library) preloads it with
``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1`` (and ``thp:always`` while huge pages
are on: jemalloc's own ``madvise(MADV_HUGEPAGE)``, what glibc's ``malloc.hugetlb`` does
otherwise). Measured on the 2-core test machine (docs/CPU_SPEED.md, "The allocator"):
decode 4-5% faster at N = 1 and 7-9% at N = 2, a 3K prefill from 3% slower (N = 2) to
5% faster (N = 1); but keeping every freed page is what makes it fast, and over a long
prompt the freed tiles of many sizes pile up: an 8K-token prefill on one rank peaked at 9.4 GB resident against glibc's
2.1 GB. With jemalloc's own decay (pages back after 10 s unused) the peak was 1.9 GB but
a 3K prefill at N = 2 11% slower and decode no faster. So glibc stays the default and
jemalloc is for decode-bound runs on short prompts. Between phases, after loading and
after a prefill, the CLI hands jemalloc's unused pages back (``release_free_memory``),
so a phase's leftovers are neither held through the next nor counted by the memory
forecast as the process's own.

``LD_PRELOAD`` is read only when a program starts, so the library rides on the
re-execution that preloads the BLAS (blas/reexec.py), as huge_pages.py's tunables do: a
rank that is not re-executed keeps glibc's malloc. An allocator the user preloads
(jemalloc, tcmalloc, mimalloc) and a ``MALLOC_CONF`` the user sets are kept. Standard
library only (this runs before MLX or MPI is loaded).
"""

from __future__ import annotations

import ctypes
import functools
import os

from ..errors import UserError
from . import huge_pages
from .switches import startup_value

ENV = "SPMD_CP_ALLOCATOR"  # "glibc" (default), "jemalloc" or a jemalloc library's path
CHOICES = ("glibc", "jemalloc")
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
        from .library_paths import library_dirs
        dirs = library_dirs()
    for directory in dirs:
        for name in LIBRARY_NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def requested() -> str:
    """``SPMD_CP_ALLOCATOR``: "glibc" (also when unset) or the path of the jemalloc
    library to preload ("jemalloc": the one found). UserError, in one line, for anything
    else, a path that is no file, or "jemalloc" where none is installed."""
    raw = startup_value(ENV)
    value = raw.lower() or "glibc"
    if value == "glibc":
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
    re-executed rank. None: glibc (the default), the user's own allocator preloaded, or
    a bad ``SPMD_CP_ALLOCATOR`` (every rank reports that as one line before the model
    loads: run/builder.py)."""
    try:
        library = requested()
    except UserError:
        return None, {}
    if library == "glibc" or users_allocator(environ):
        return None, {}
    if CONF in environ:
        return library, {}  # the user's settings stand
    try:
        huge = huge_pages.requested() == "on"
    except UserError:
        huge = False
    return library, {CONF: RETAIN_FREED_PAGES + (f",{HUGE_PAGES}" if huge else "")}


@functools.lru_cache(maxsize=None)
def _mallctl():
    """jemalloc's ``mallctl`` where this process allocates with jemalloc (which exports
    it when it replaces malloc), else None (fixed when the process starts: kept)."""
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
    """The allocator this process runs, e.g. "jemalloc 5.3.0" or "glibc malloc" (the
    same on ranks set up alike: doctor compares it)."""
    version = jemalloc_version()
    if version is not None:
        return f"jemalloc {version}"
    own = users_allocator(environ)
    if own:
        return f"{os.path.basename(own)} (preloaded by the user)"
    if environ.get(ENV, "").strip().lower() not in ("", "glibc"):
        return "glibc malloc (not re-executed)"  # asked for jemalloc, no BLAS re-exec
    return "glibc malloc"
