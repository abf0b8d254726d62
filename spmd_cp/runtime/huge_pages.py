"""Transparent huge pages for a rank's large buffers (glibc's ``malloc.hugetlb`` tunable).

MLX's CPU backend takes its buffers from ``malloc``: the weights, the KV cache and every
intermediate of a step. A decode step streams all the weights and the KV shard once,
and over 4 KiB pages that stream takes a TLB miss every 4 KiB. glibc 2.35 and later can
ask the kernel for transparent huge pages (2 MiB) on the memory it maps for the heap and
for large blocks (``glibc.malloc.hugetlb=1``: ``madvise(MADV_HUGEPAGE)``). Most Linux
systems leave THP to ``madvise`` (or ``always``), so the advice is what it takes; where
THP is ``never`` it changes nothing.

Two more tunables keep the advice from costing time elsewhere. glibc trims the heap's
free top back to the kernel once it exceeds a threshold that starts at 128 KiB and grows
with the blocks freed; on huge pages each regrowth zeroes whole 2 MiB pages again, which
made loading 0.8 s slower and a prefill 2-4% slower. So the heap keeps up to 1 GiB of
free top (``trim_threshold``: memory it holds for the next step rather than returns),
and blocks under 32 MiB come from the heap from the start (``mmap_threshold``: the value
glibc's own adjustment ends at), as they would after warm-up. Measured on the 2-core
test machine (docs/CPU_SPEED.md, "Huge pages"): decode 3-11% faster at N = 1 and N = 2,
loading as without, prefill as without at N = 1 and at 8K tokens (2-4% slower at N = 2
over 3K tokens), the same peak resident memory.

glibc reads its tunables only when a program starts, so the variable rides on the
re-execution that preloads the BLAS (blas/reexec.py): a rank that is not re-executed
(the user preloaded a BLAS, or none was found) runs as started. A tunable the user set
is kept. Where the re-execution preloads jemalloc (allocator.py) glibc's malloc is not
used; jemalloc gets the same advice through its own ``thp:always``.
``SPMD_CP_HUGE_PAGES=off`` leaves malloc alone. Standard library only (this runs before
MLX or MPI is loaded).
"""

from __future__ import annotations

import os

from ..errors import UserError
from .switches import startup_setting, startup_value

ENV = "SPMD_CP_HUGE_PAGES"  # "on" (default) or "off"
CHOICES = ("on", "off")
TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"
# What a re-executed rank starts with, unless the user set the same tunable (see above).
SETTINGS = {HUGETLB: "1",
            "glibc.malloc.mmap_threshold": str(32 << 20),
            "glibc.malloc.trim_threshold": str(1 << 30)}
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
GLIBC_WITH_HUGETLB = (2, 35)  # the first glibc that knows the tunable (older ones ignore it)


def requested() -> str:
    """``SPMD_CP_HUGE_PAGES``: "on" (also when unset) or "off"."""
    return startup_setting(ENV, CHOICES, "on")


def _tunables(value: str) -> dict:
    """``GLIBC_TUNABLES``'s ``name=value`` pairs, in order (colon-separated)."""
    pairs = (item.split("=", 1) for item in value.split(":") if "=" in item)
    return {name.strip(): setting for name, setting in pairs}


def startup_environment(environ=os.environ) -> dict:
    """The variables a re-executed rank should start with: ``GLIBC_TUNABLES`` with
    ``SETTINGS`` added where the user's own value does not name them, or nothing (not
    wanted, a bad value, or the user set ``glibc.malloc.hugetlb`` already)."""
    try:
        if requested() != "on":
            return {}
    except UserError:
        return {}  # every rank reports it as one line before the model loads (run/builder.py)
    current = environ.get(TUNABLES, "")
    own = _tunables(current)
    if HUGETLB in own:
        return {}  # the user decided about huge pages
    added = ":".join(f"{name}={value}" for name, value in SETTINGS.items() if name not in own)
    return {TUNABLES: f"{current}:{added}" if current else added}


def system_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), or None (not Linux, no THP)."""
    try:
        with open(THP_ENABLED) as f:
            words = f.read().split()
    except OSError:
        return None
    chosen = [w[1:-1] for w in words if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def huge_resident_bytes() -> int | None:
    """Bytes of this process held in transparent huge pages, or None where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def describe() -> str:
    """What this process does about huge pages, e.g. "glibc.malloc.hugetlb=1, THP madvise"
    or, where malloc is jemalloc, "jemalloc thp:always, THP madvise" (the same on ranks
    set up alike: doctor compares it)."""
    from .allocator import jemalloc_version

    mode = system_mode()
    if mode is None:
        return "unavailable (no transparent huge pages)"
    if jemalloc_version() is not None:  # malloc is jemalloc (allocator.py): its own advice
        conf = os.environ.get("MALLOC_CONF", "")
        if "thp:always" in conf.replace(" ", "").split(","):
            return f"jemalloc thp:always, THP {mode}"
        why = f"{ENV}=off" if startup_value(ENV).lower() == "off" else f"MALLOC_CONF={conf}"
        return f"not advised ({why}), THP {mode}"
    setting = _tunables(os.environ.get(TUNABLES, "")).get(HUGETLB)
    if setting is None:
        why = f"{ENV}=off" if startup_value(ENV).lower() == "off" else "not re-executed"
        return f"not advised ({why}), THP {mode}"
    glibc = glibc_version()
    if glibc is None or glibc < GLIBC_WITH_HUGETLB:
        found = "not glibc" if glibc is None else f"glibc {glibc[0]}.{glibc[1]}"
        return f"{HUGETLB}={setting} ignored ({found}; it needs glibc 2.35), THP {mode}"
    return f"{HUGETLB}={setting}, THP {mode}"
