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

from conftest import needs_c_helpers

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


@needs_openblas
def test_the_line_names_the_openblas_kernels_and_who_chose_them(tmp_path):
    """OpenBLAS's kernels are named in the start-up line (its DYNAMIC_ARCH build picks
    them by CPUID), and OPENBLAS_CORETYPE, which forces them, is named as their reason,
    with the same products."""
    (info,), _, _ = run_probe(tmp_path, OPENBLAS_CORETYPE="Haswell")
    assert "Haswell kernels forced by OPENBLAS_CORETYPE" in info["line"], info["line"]
    assert info["err"] < 1e-3
    # (as the environment has it: some machines set it for an OpenBLAS that needs it)
    (info,), _, _ = run_probe(tmp_path)
    assert " kernels" in info["line"], info["line"]
    assert ("forced" in info["line"]) == bool(os.environ.get("OPENBLAS_CORETYPE"))


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
    (info,), _, _ = run_probe(tmp_path, SPMD_CP_BLAS=OPENBLAS, SPMD_CP_CACHE=str(tmp_path))
    preloaded = info["env"]["LD_PRELOAD"].split()
    assert preloaded[-1] == OPENBLAS  # behind the matrix-vector forward, where it builds
    assert info["kind"] == "openblas" and info["path"] == OPENBLAS


# cblas_sgemm as libmlx.so resolves it (the global scope), called with every layout a
# row-major caller can pass: the shapes the forward takes (matrix-vector, a few rows
# times a small matrix) and others, both
# transposes, leading dimensions wider than the rows, alpha and beta, and an output
# full of NaN where beta = 0 (sgemm's contract overwrites it). Then MLX's own products.
GEMV_PROBE = """
import ctypes, json, os, sys
from spmd_cp import blas
blas.ensure_fast_blas()
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(0)
sgemm = ctypes.CDLL(None).cblas_sgemm
P, F = ctypes.c_void_p, ctypes.c_float
worst, cases = 0.0, 0
# (2, 64, 300): a few rows times a cached matrix (attention's values): one pass, or row
# by row where it is given transposed;
# (3, 600, 600): the same rows times 1.4 MB, wider than the one-pass kernel, to sgemm;
# (100, 3, 64), (70, 8, 37): many rows times a few columns given as rows (attention's
# scores), one pass; (3, 1500, 64): the scores the other way round (a few rows times
# many rows given as columns), one pass; (3, 64, 5000), (6, 40, 100): a few rows times
# a long matrix (attention's values beyond the cache), one pass. Then more of the AVX2
# kernels' counts of query columns (2, 5, 7; 3 and 8 above) and of probability rows (4,
# 5, 8; 2, 3 and 6 above), over 260-302 keys or values (tiles of 128 and a remainder,
# key blocks of 4, 2 and 1 and a remainder), widths not a multiple of the vectors (69,
# 71, 72); one row or column (1, 300, 64), (1, 40, 300) is sgemv's, or the few-rows
# kernel's where the matrix is given plain and the row is 64 or more long
for m, n, k in [(7, 1, 5), (1, 9, 6), (1, 1, 8), (33, 1, 64), (1, 40, 17), (3, 4, 5),
                (2, 64, 300), (3, 600, 600), (100, 3, 64), (70, 8, 37), (3, 1500, 64),
                (3, 64, 5000), (6, 40, 100),
                (1, 300, 64), (2, 300, 69), (5, 300, 64), (7, 300, 64), (301, 5, 64),
                (302, 7, 71), (4, 72, 300), (5, 64, 300), (8, 64, 260), (1, 40, 300)]:
    for ta in (111, 112):
        for tb in (111, 112):
            for alpha, beta in [(1.0, 0.0), (0.5, 0.0), (1.0, 1.0), (2.0, -0.5)]:
                pad = 3  # every leading dimension wider than its rows
                A = rng.standard_normal((k, m + pad) if ta == 112 else (m, k + pad)).astype(np.float32)
                B = rng.standard_normal((n, k + pad) if tb == 112 else (k, n + pad)).astype(np.float32)
                C = rng.standard_normal((m, n + pad)).astype(np.float32)
                if beta == 0.0:
                    C[:] = np.nan
                opA = (A[:, :m].T if ta == 112 else A[:, :k]).astype(np.float64)
                opB = (B[:, :k].T if tb == 112 else B[:, :n]).astype(np.float64)
                want = alpha * opA @ opB + (beta * C[:, :n].astype(np.float64) if beta else 0)
                sgemm(101, ta, tb, m, n, k, F(alpha), P(A.ctypes.data), A.shape[1],
                      P(B.ctypes.data), B.shape[1], F(beta), P(C.ctypes.data), C.shape[1])
                worst = max(worst, float(np.abs(C[:, :n] - want).max()))
                cases += 1
W = rng.standard_normal((6, 48, 40)).astype(np.float32)
x = rng.standard_normal((6, 40, 1)).astype(np.float32)
products = {"W @ x": (mx.array(W) @ mx.array(x), W.astype(np.float64) @ x),
            "x.T @ W.T": (mx.array(x).swapaxes(1, 2) @ mx.array(W).swapaxes(1, 2),
                          x.swapaxes(1, 2).astype(np.float64) @ W.swapaxes(1, 2)),
            "columns": (mx.array(W)[:, 5:30, 3:40] @ mx.array(x)[:, 3:40],
                        W[:, 5:30, 3:40].astype(np.float64) @ x[:, 3:40])}
mlx_worst = max(float(np.abs(np.array(got) - want).max()) for got, want in products.values())
info = blas.describe_blas()
print("RESULT " + json.dumps({"worst": worst, "cases": cases, "mlx_worst": mlx_worst,
                              "forward": info["gemv_forward"], "line": info["line"],
                              "preload": os.environ.get("LD_PRELOAD")}))
"""


def libraries(probe: dict) -> list[str]:
    """The probe's LD_PRELOAD without the allocator (runtime/allocator.py puts jemalloc
    first where installed; tests/test_allocator.py checks it)."""
    return [p for p in probe["preload"].split() if "jemalloc" not in p]


def run_result_script(script, tmp_path, timeout: float = 120, **env) -> dict:
    """Run a probe script (it re-execs onto the BLAS with the forward) with a cache of its
    own under tmp_path; its "RESULT {json}" line, parsed."""
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=clean_env(SPMD_CP_CACHE=str(tmp_path / "cache"), **env),
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def gemv_probe(tmp_path, **env) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "gemv_probe.py"
    script.write_text(GEMV_PROBE)
    return run_result_script(script, tmp_path, **env)


@needs_openblas
@needs_c_helpers
def test_matrix_vector_forward_equals_numpy_in_every_layout(tmp_path):
    """gemv_forward.c, built and preloaded by the re-exec, computes what sgemm's contract
    says (float64 numpy reference, float32 rounding) for every layout, and MLX's matmuls
    go through it; SPMD_CP_GEMV_FORWARD=0 leaves it out and gives the same answers."""
    forward = gemv_probe(tmp_path)
    assert forward["forward"] and "through sgemv" in forward["line"], forward["line"]
    assert "spmd-cp-gemv-forward-" in libraries(forward)[0]  # ahead of the BLAS
    plain = gemv_probe(tmp_path, SPMD_CP_GEMV_FORWARD="0")
    assert not plain["forward"] and "gemv-forward" not in plain["preload"]
    # A compiler that fails (and an empty cache): the BLAS alone, as before the forward.
    unbuilt = gemv_probe(tmp_path / "other", CC=shutil.which("false"))
    assert not unbuilt["forward"] and libraries(unbuilt) == [OPENBLAS]
    assert "(no sgemv forward: false failed" in unbuilt["line"], unbuilt["line"]
    for result in (forward, plain, unbuilt):
        assert result["cases"] == 368
        assert result["worst"] < 2e-3, result  # sums of at most 5,000 products of N(0,1)
        assert result["mlx_worst"] < 1e-4, result


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


def test_missing_c_source_is_a_fallback_not_a_crash(tmp_path):
    """An install that lost a C source (a wheel built without package data) reports a
    reason the callers log and fall back on, as they do without a compiler."""
    from spmd_cp.runtime import native

    with pytest.raises(RuntimeError, match="cannot read absent.c .*reinstall spmd-cp"):
        native.built_path(tmp_path / "absent.c", "blas", "absent")
