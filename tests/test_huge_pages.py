"""runtime/huge_pages.py: glibc's huge-page advice rides on the BLAS re-exec.

The tunable acts only when a process starts, so the mechanism is checked in fresh
processes: each re-executes itself as a rank does, multiplies a 64 MiB MLX matrix by a
vector and reports its environment and how much of it the kernel holds in huge pages.
"""

import json
import os
import platform
import subprocess
import sys

import pytest

from spmd_cp.errors import UserError
from spmd_cp.runtime import allocator, huge_pages

from test_blas import clean_env, needs_openblas

BIG = 64 << 20  # bytes of the probe's matrix

PROBE = """
import json, os
from spmd_cp import blas
blas.ensure_fast_blas()
import mlx.core as mx
import numpy as np
from spmd_cp.runtime import allocator, huge_pages
mx.random.seed(0)
w = mx.random.normal((4096, 4096))  # 64 MiB of MLX's own, from malloc
x = mx.random.normal((4096, 1))
y = w @ x
mx.eval(w, y)
huge = huge_pages.huge_resident_bytes()  # before numpy's copies (numpy advises its own)
a, v = np.array(w, np.float64), np.array(x, np.float64)
err = float(np.abs(np.array(y)[:, 0] - (a @ v)[:, 0]).max())
print("RESULT " + json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"),
      "describe": huge_pages.describe(), "huge": huge, "mode": huge_pages.system_mode(),
      "allocator": allocator.describe(), "malloc_conf": os.environ.get("MALLOC_CONF"),
      "err": err}), flush=True)
"""


def run_probe(tmp_path, **env):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    base = clean_env(**env)
    for name in (huge_pages.TUNABLES, huge_pages.ENV, allocator.ENV, allocator.CONF):
        # only what the test sets
        if name not in env:
            base.pop(name, None)
    proc = subprocess.run([sys.executable, str(script)], env=base,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    info = json.loads(line[len("RESULT "):])
    assert info["err"] < 1e-2, info  # float32 sums of 4,096 products of N(0,1) values
    return info


OURS = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:" \
       "glibc.malloc.trim_threshold=1073741824"


def test_startup_environment_adds_the_tunables_and_keeps_the_users():
    assert huge_pages.startup_environment({}) == {"GLIBC_TUNABLES": OURS}
    assert huge_pages.startup_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:" + OURS}
    # A threshold the user chose stands; the others are added.
    assert huge_pages.startup_environment(
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096:glibc.malloc.hugetlb=1:"
                          "glibc.malloc.mmap_threshold=33554432"}
    # A hugetlb the user chose stands, whatever its value.
    assert huge_pages.startup_environment(
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"}) == {}


def test_opt_out_and_a_bad_value(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "off")
    assert huge_pages.requested() == "off"
    assert huge_pages.startup_environment({}) == {}
    monkeypatch.setenv(huge_pages.ENV, "sometimes")
    with pytest.raises(UserError, match="SPMD_CP_HUGE_PAGES='sometimes'"):
        huge_pages.requested()
    assert huge_pages.startup_environment({}) == {}  # reported later, as one line


def test_glibc_version_agrees_with_platform():
    name, version = platform.libc_ver()
    if name != "glibc":
        assert huge_pages.glibc_version() is None
    else:
        assert huge_pages.glibc_version() == tuple(int(p) for p in version.split(".")[:2])


def test_system_mode_reads_the_kernels_choice():
    mode = huge_pages.system_mode()
    if not os.path.exists(huge_pages.THP_ENABLED):
        assert mode is None
    else:
        assert mode in ("always", "madvise", "never")


@needs_openblas
def test_a_reexecuted_process_holds_its_large_buffers_in_huge_pages(tmp_path):
    """glibc's malloc (jemalloc's own advice: test_allocator.py)."""
    info = run_probe(tmp_path, SPMD_CP_ALLOCATOR="glibc")
    assert info["tunables"] == OURS and info["malloc_conf"] is None
    assert info["allocator"] == "glibc malloc"
    if info["mode"] is None:
        assert info["describe"] == "unavailable (no transparent huge pages)"
        return
    glibc = huge_pages.glibc_version()
    if glibc is None or glibc < huge_pages.GLIBC_WITH_HUGETLB:
        assert "glibc.malloc.hugetlb=1 ignored" in info["describe"]
        return
    assert info["describe"] == f"glibc.malloc.hugetlb=1, THP {info['mode']}"
    if info["mode"] in ("madvise", "always"):
        assert info["huge"] >= BIG // 2, info  # the matrix, less its unaligned ends


@needs_openblas
def test_opted_out_or_user_set_processes_keep_their_own(tmp_path):
    info = run_probe(tmp_path, SPMD_CP_HUGE_PAGES="off", SPMD_CP_ALLOCATOR="glibc")
    assert info["tunables"] is None
    if info["mode"] is None:
        return  # nothing to advise
    assert info["describe"] == f"not advised (SPMD_CP_HUGE_PAGES=off), THP {info['mode']}"
    if info["mode"] == "madvise":  # nothing else in the process asks for huge pages
        assert info["huge"] < BIG // 2, info
    info = run_probe(tmp_path, GLIBC_TUNABLES="glibc.malloc.hugetlb=0",
                     SPMD_CP_ALLOCATOR="glibc")
    assert info["tunables"] == "glibc.malloc.hugetlb=0"
    assert info["describe"].startswith("glibc.malloc.hugetlb=0")
