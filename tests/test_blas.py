"""spmd_cp.blas: the re-exec onto an optimized BLAS, checked in fresh processes.

LD_PRELOAD only takes effect when a process starts, so every check runs a new Python (or
`mpiexec -n 2`) with a clean environment and reads back what that process reports.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from spmd_cp import blas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENBLAS = blas.find_fast_blas("openblas") if sys.platform.startswith("linux") else None
needs_openblas = pytest.mark.skipif(
    OPENBLAS is None, reason=f"no OpenBLAS with cblas symbols here ({blas.INSTALL_HINT})")

# Prints, after ensure_fast_blas(), what the process uses and an MLX matmul's error vs numpy.
PROBE = """
import json, os, sys
from spmd_cp import blas
def emit(line):  # one write(2) per line: ranks share the stdout pipe, lines must not mix
    os.write(1, (line + "\\n").encode())
emit(f"before {os.getpid()}")
status = blas.ensure_fast_blas()
if "--mpi" in sys.argv:
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
else:
    rank = 0
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(rank)
a = rng.standard_normal((300, 257)).astype(np.float32)
b = rng.standard_normal((257, 190)).astype(np.float32)
c = np.array(mx.array(a) @ mx.array(b))
err = float(np.abs(c - a.astype(np.float64) @ b.astype(np.float64)).max())
info = blas.describe_blas()
info.update(status=status, rank=rank, pid=os.getpid(), err=err, argv=sys.argv[1:],
            env={k: os.environ.get(k) for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")})
emit("RESULT " + json.dumps(info))
"""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", blas.ENV_GUARD, blas.ENV_CHOICE, *blas.LOCAL_SIZE_VARS)
           and not k.endswith("_NUM_THREADS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_probe(tmp_path, *args, launcher=(), **env):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run([*launcher, sys.executable, str(script), *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Each line is written atomically, but mpiexec forwards several ranks' output: find
    # every "RESULT {...}" wherever it sits rather than trusting line boundaries.
    decoder, out = json.JSONDecoder(), proc.stdout
    results, at = [], out.find("RESULT ")
    while at >= 0:
        info, end = decoder.raw_decode(out, at + len("RESULT "))
        results.append(info)
        at = out.find("RESULT ", end)
    befores = re.findall(r"before \d+", out)
    return results, befores, proc.stderr


@needs_openblas
def test_reexec_maps_openblas_and_matmul_matches_numpy(tmp_path):
    (info,), befores, _ = run_probe(tmp_path, "a b", "--flag")
    assert info["kind"] == "openblas" and info["fast"], info["line"]
    assert info["source"] == "LD_PRELOAD"
    assert os.path.realpath(OPENBLAS) in map(os.path.realpath, info["mapped"])
    assert info["line"].startswith("BLAS: OpenBLAS")
    assert info["err"] < 1e-3  # float32 sums of 257 products of N(0,1) values
    # The script ran twice in the same process (execv keeps the pid) with the same arguments.
    assert befores == [f"before {info['pid']}"] * 2
    assert info["argv"] == ["a b", "--flag"]
    assert info["status"] == "active"


def test_opt_out_keeps_reference_blas(tmp_path):
    (info,), befores, _ = run_probe(tmp_path, SPMD_CP_BLAS="reference")
    assert info["status"] == "opt-out" and len(befores) == 1
    assert info["kind"] == "reference" and not info["fast"]
    assert "slow" in info["line"] and info["env"]["LD_PRELOAD"] is None
    assert info["err"] < 1e-3


def test_bad_explicit_library_warns_and_keeps_reference(tmp_path):
    (info,), _, stderr = run_probe(tmp_path, SPMD_CP_BLAS=str(tmp_path / "libnothing.so"))
    assert info["status"] == "not-found" and info["kind"] == "reference"
    assert "libnothing.so" in stderr


@needs_openblas
def test_explicit_library_is_used(tmp_path):
    (info,), _, _ = run_probe(tmp_path, SPMD_CP_BLAS=OPENBLAS)
    assert info["env"]["LD_PRELOAD"].split()[0] == OPENBLAS
    assert info["kind"] == "openblas"


@needs_openblas
@pytest.mark.parametrize("env, expected", [
    ({}, lambda cpus: cpus),
    ({"MPI_LOCALNRANKS": "2"}, lambda cpus: max(1, cpus // 2)),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "64"}, lambda cpus: 1),
    ({"OPENBLAS_NUM_THREADS": "1", "MPI_LOCALNRANKS": "1"}, lambda cpus: 1),  # user's choice
])
def test_thread_count(tmp_path, env, expected):
    (info,), _, _ = run_probe(tmp_path, **env)
    want = expected(blas.usable_cpus())
    assert info["threads"] == want  # asked from OpenBLAS itself
    assert info["env"]["OPENBLAS_NUM_THREADS"] == str(want)


def test_stdin_script_is_not_reexecuted():
    code = "from spmd_cp import blas; print(blas.ensure_fast_blas())"
    proc = subprocess.run([sys.executable, "-"], input=code, env=clean_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() in ("cannot-reexec", "not-found"), proc.stderr


@needs_openblas
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_mpiexec_two_ranks_both_reexec(tmp_path):
    pytest.importorskip("mpi4py")
    infos, befores, _ = run_probe(tmp_path, "--mpi", launcher=("mpiexec", "-n", "2"))
    assert sorted(i["rank"] for i in infos) == [0, 1]
    assert len(befores) == 4  # each rank ran the top of the script twice
    for info in infos:
        assert info["kind"] == "openblas" and info["source"] == "LD_PRELOAD", info["line"]
        assert info["threads"] == max(1, blas.usable_cpus() // 2)
        assert info["err"] < 1e-3


def test_blas_kind():
    assert blas.blas_kind("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3") == "openblas"
    assert blas.blas_kind("/x/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference"
    assert blas.blas_kind("/x/numpy.libs/libscipy_openblas64_-32a4b2a6.so") == "numpy-private"
    assert blas.blas_kind("/venv/lib/libmkl_rt.so.2") == "mkl"
    assert blas.blas_kind("/usr/lib/libc.so.6") is None


def test_local_ranks_and_default_threads(monkeypatch):
    for var in blas.LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert blas.local_ranks() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")
    assert blas.local_ranks() == 3
    monkeypatch.setenv("MPI_LOCALNRANKS", "not-a-number")
    assert blas.local_ranks() == 3
    assert blas.default_threads() == max(1, blas.usable_cpus() // 3)
