"""runtime/allocator.py: jemalloc preloaded with the BLAS, its settings, the opt-outs.

The choice acts only when a process starts, so it is checked in fresh processes (the
probe of test_huge_pages.py: each re-executes itself as a rank does, multiplies a
64 MiB MLX matrix by a vector and reports its allocator, settings and huge pages).
"""

import json
import os
import subprocess
import sys

import pytest

from spmd_cp.errors import UserError
from spmd_cp.runtime import allocator, huge_pages

from test_blas import clean_env, needs_openblas
from test_huge_pages import BIG, run_probe

JEMALLOC = allocator.find_jemalloc() if sys.platform.startswith("linux") else None
needs_jemalloc = pytest.mark.skipif(
    JEMALLOC is None, reason=f"no jemalloc here ({allocator.INSTALL_HINT})")


def test_find_jemalloc_looks_in_the_directories_given(tmp_path):
    empty, holding = tmp_path / "empty", tmp_path / "lib"
    empty.mkdir()
    holding.mkdir()
    (holding / "libjemalloc.so.2").write_bytes(b"")
    assert allocator.find_jemalloc([str(empty)]) is None
    found = allocator.find_jemalloc([str(empty), str(holding)])
    assert found == str(holding / "libjemalloc.so.2")


RETAIN = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def test_requested_values_and_one_line_errors(monkeypatch, tmp_path):
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.requested() == "glibc"
    monkeypatch.setenv(allocator.ENV, " GLIBC ")
    assert allocator.requested() == "glibc"
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    monkeypatch.setenv(allocator.ENV, str(library))
    assert allocator.requested() == str(library)
    monkeypatch.setenv(allocator.ENV, str(tmp_path / "missing.so"))
    with pytest.raises(UserError, match=r"SPMD_CP_ALLOCATOR=.*missing.so: no such file"):
        allocator.requested()
    monkeypatch.setenv(allocator.ENV, "tcmalloc")
    with pytest.raises(UserError, match="SPMD_CP_ALLOCATOR='tcmalloc': expected one of"):
        allocator.requested()
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    if JEMALLOC is None:
        with pytest.raises(UserError, match="apt-get install libjemalloc2"):
            allocator.requested()
    else:
        assert allocator.requested() == JEMALLOC


@needs_jemalloc
def test_startup_choice_settings_and_what_the_user_set_stands(monkeypatch):
    for name in (allocator.ENV, huge_pages.ENV):
        monkeypatch.delenv(name, raising=False)
    assert allocator.startup_choice({}) == (None, {})  # glibc unless asked
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    assert allocator.startup_choice({}) == (JEMALLOC, {"MALLOC_CONF": RETAIN + ",thp:always"})
    # The user's MALLOC_CONF and the user's own allocator stand; other preloads do not count.
    assert allocator.startup_choice({"MALLOC_CONF": "narenas:2"}) == (JEMALLOC, {})
    assert allocator.startup_choice({"LD_PRELOAD": "/opt/lib/libtcmalloc.so.4"}) == (None, {})
    assert allocator.startup_choice({"LD_PRELOAD": "/opt/lib/libfoo.so"})[0] == JEMALLOC
    monkeypatch.setenv(huge_pages.ENV, "off")
    assert allocator.startup_choice({}) == (JEMALLOC, {"MALLOC_CONF": RETAIN})
    monkeypatch.setenv(allocator.ENV, "bogus")  # reported later, as one line
    assert allocator.startup_choice({}) == (None, {})


def test_this_test_process_runs_the_allocator_it_was_started_with():
    """The test runner is not re-executed: glibc's malloc unless LD_PRELOAD says else."""
    preloads = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preloads:
        assert allocator.describe().startswith("jemalloc ")
    elif not allocator.users_allocator():
        assert allocator.jemalloc_version() is None
        assert allocator.describe().startswith("glibc malloc")


@needs_openblas
@needs_jemalloc
def test_a_reexecuted_process_allocates_with_jemalloc_on_huge_pages(tmp_path):
    info = run_probe(tmp_path, SPMD_CP_ALLOCATOR="jemalloc")
    assert info["allocator"].startswith("jemalloc "), info
    assert info["malloc_conf"] == RETAIN + ",thp:always"
    assert info["tunables"] is None  # glibc's tunables only where glibc allocates
    if info["mode"] is None:
        assert info["describe"] == "unavailable (no transparent huge pages)"
        return
    assert info["describe"] == f"jemalloc thp:always, THP {info['mode']}"
    if info["mode"] in ("madvise", "always"):
        assert info["huge"] >= BIG // 2, info  # the matrix, on jemalloc's huge pages


@needs_openblas
@needs_jemalloc
def test_glibc_by_default_and_what_the_user_set_stands(tmp_path):
    info = run_probe(tmp_path)  # the default
    assert info["allocator"] == "glibc malloc" and info["malloc_conf"] is None
    assert info["tunables"].startswith("glibc.malloc.hugetlb=1")
    info = run_probe(tmp_path, SPMD_CP_ALLOCATOR="jemalloc", SPMD_CP_HUGE_PAGES="off")
    assert info["allocator"].startswith("jemalloc ") and info["malloc_conf"] == RETAIN
    if info["mode"] is not None:
        assert info["describe"] == f"not advised (SPMD_CP_HUGE_PAGES=off), THP {info['mode']}"
    if info["mode"] == "madvise":  # nothing else in the process asks for huge pages
        assert info["huge"] < BIG // 2, info
    info = run_probe(tmp_path, SPMD_CP_ALLOCATOR="jemalloc", MALLOC_CONF="narenas:2")
    assert info["allocator"].startswith("jemalloc ") and info["malloc_conf"] == "narenas:2"
    if info["mode"] is not None:
        assert info["describe"] == f"not advised (MALLOC_CONF=narenas:2), THP {info['mode']}"


RELEASE_PROBE = """
import json
from spmd_cp import blas
blas.ensure_fast_blas()
import mlx.core as mx
from spmd_cp.runtime import allocator, resident
big = mx.ones((64, 1 << 20))  # 256 MiB of MLX's own, from malloc
mx.eval(big)
held = resident.resident_bytes()
del big
kept = resident.resident_bytes()
released = allocator.release_free_memory()
print("RESULT " + json.dumps({"held": held, "kept": kept, "after": resident.resident_bytes(),
      "released": released, "allocator": allocator.describe()}), flush=True)
"""


@needs_openblas
@needs_jemalloc
def test_freed_pages_are_kept_until_released_between_phases(tmp_path):
    """jemalloc keeps a freed 256 MiB buffer's pages (dirty_decay_ms:-1) until
    release_free_memory purges them, as the CLI does after loading and after a prefill;
    under glibc nothing is purged (its large blocks went back when freed)."""
    script = tmp_path / "release.py"
    script.write_text(RELEASE_PROBE)
    big = 256 << 20
    for chosen, jemalloc in (("jemalloc", True), ("glibc", False)):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=120, env=clean_env(SPMD_CP_ALLOCATOR=chosen))
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout.split("RESULT ", 1)[1])
        assert info["released"] is jemalloc, info
        if jemalloc:
            assert info["kept"] > info["held"] - big // 4, info  # freed, still resident
            assert info["after"] < info["kept"] - big // 2, info
        else:
            assert info["kept"] < info["held"] - big // 2, info
