"""Linux's batch scheduling policy (``SCHED_BATCH``) for every thread of a rank.

A rank is two busy threads: Python builds each step's MLX graph and hands its nodes to
MLX's compute thread one at a time. Under the default policy each hand-off may wake the
other thread and preempt the one running; with ranks sharing cores (two ranks on two
cores: four busy threads) a decode step's profile had 11.6% of its samples in the
kernel's scheduler. ``SCHED_BATCH`` is the policy Linux has for CPU-bound,
non-interactive work: no wake-up preemption, so each thread runs out its slice. It needs
no privilege and leaves priorities alone. A small gain, measured at N = 2 on 2 cores
(docs/CPU_SPEED.md, "Thread scheduling").

Set at start-up on every thread there is; threads started later inherit it (MLX's compute
thread, BLAS and MPI threads), as does the re-executed process (blas/reexec.py).
``SPMD_CP_SCHED=default`` leaves the policy as it was. Standard library only.
"""

from __future__ import annotations

import os

from ..errors import UserError
from .switches import startup_setting

ENV = "SPMD_CP_SCHED"  # "batch" (default) or "default"
CHOICES = ("batch", "default")
POLICY_NAMES = {getattr(os, name): name[6:].lower()
                for name in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO",
                             "SCHED_RR") if hasattr(os, name)}


def requested() -> str:
    """``SPMD_CP_SCHED``: "batch" (also when unset) or "default"."""
    return startup_setting(ENV, CHOICES, "batch")


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # the calling thread


def use_batch_scheduling() -> None:
    """Put every thread of this process under SCHED_BATCH where wanted and possible (what
    each rank runs under, ``doctor`` shows: ``scheduling_of_threads``)."""
    try:
        if requested() != "batch" or not hasattr(os, "SCHED_BATCH"):
            return
    except UserError:
        return  # every rank reports it before the model loads (run/builder.py)
    for tid in _threads():
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:  # leave real-time or idle
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError:  # e.g. a seccomp-restricted container: the policy stays
            return


def scheduling_of_threads() -> str:
    """The policies of this process's threads by name, e.g. "batch" or "batch, other"
    (``other``: Linux's default)."""
    if not hasattr(os, "sched_getscheduler"):
        return "unsupported"
    names = set()
    for tid in _threads():
        try:
            names.add(POLICY_NAMES.get(os.sched_getscheduler(tid), "unknown"))
        except OSError:
            continue  # the thread ended meanwhile
    return ", ".join(sorted(names))
