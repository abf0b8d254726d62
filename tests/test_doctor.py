"""`spmd-cp doctor`: the per-rank report, the mismatch exit code, the calibration it writes.

The pure parts (checksum and its cache, the mismatch sentences, the auto crossover, the
GGUF header reader) are checked in one process against hashlib, hand-built reports, the
closed-form rule and mx.load; the command itself under mpiexec, including an MPMD launch
in which the two ranks are handed different model files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import pytest

from conftest import MPIEXEC, SPMD_CP, needs_c_helpers, run_cli, run_ranks, write_tiny_model
from spmd_cp.attention.choose import LinkAndCompute
from spmd_cp.cli.doctor import auto_crossover, head_counts, model_checksum
from spmd_cp.cli.doctor_checks import EXIT_MISMATCH, find_mismatches
from spmd_cp.errors import UserError
from spmd_cp.runtime import huge_pages


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SPMD_CP_CACHE", str(path))
    return path


# -- pure ------------------------------------------------------------------------------------
def test_model_checksum_of_file_and_directory_is_cached_by_size_and_mtime(tmp_path, cache):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    assert model_checksum(str(gguf)) == hashlib.sha256(gguf.read_bytes()).hexdigest()

    model = tmp_path / "dir"
    model.mkdir()
    files = {"config.json": b'{"model_type": "llama"}', "model-00001.safetensors": b"a" * 1000,
             "model-00002.safetensors": b"b" * 1000, "tokenizer.json": b"{}"}
    for name, data in files.items():
        (model / name).write_bytes(data)
    lines = "".join(f"{name} {hashlib.sha256(files[name]).hexdigest()}\n"
                    for name in ("config.json", "model-00001.safetensors",
                                 "model-00002.safetensors"))  # the tokenizer is not weights
    expected = hashlib.sha256(lines.encode()).hexdigest()
    assert model_checksum(str(model)) == expected
    entries = json.loads((cache / "checksums.json").read_text())
    assert len(entries) == 4 and os.path.realpath(gguf) in entries

    # Same size and mtime: the cached hash is trusted (the file is not read again) ...
    shard = model / "model-00002.safetensors"
    stat = shard.stat()
    shard.write_bytes(b"c" * 1000)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_checksum(str(model)) == expected
    # ... a new mtime makes it hash again.
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert model_checksum(str(model)) != expected

    with pytest.raises(UserError, match="not found"):
        model_checksum(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        model_checksum(str(tmp_path / "empty"))


def report(host, checksum="aaaa" * 16, **overrides):
    base = {"host": host, "model_checksum": checksum, "model_error": None, "spmd_cp": "0.1.0",
            "mlx": "0.32.4", "mlx_lm": "0.32.2", "mpi4py": "4.1.2",
            "mpi_library": "MPICH Version: 5.0.2", "python": "3.11.7"}
    return {**base, **overrides}


def test_find_mismatches_names_the_odd_ranks_and_their_hosts():
    assert find_mismatches([report("a"), report("a"), report("b")]) == []
    odd = "bbbb" * 16
    problems = find_mismatches([report("a"), report("a"), report("b", odd)])
    assert problems == [f"model checksum differs: rank 2 (host b) has {odd[:16]}..., "
                        f"ranks 0,1 have {'aaaa' * 4}..."]
    # A tie: rank 0's value is the reference; a version and a missing model are named too.
    problems = find_mismatches([report("a"), report("b", mlx="0.31.0"),
                                report("c", checksum=None, model_error="model not found: /m")])
    assert problems == ["model unusable on rank 2 (host c): model not found: /m",
                        "MLX version differs: rank 1 (host b) has 0.31.0, ranks 0,2 have 0.32.4"]


def test_auto_crossover_agrees_with_the_closed_form_rule():
    measured = LinkAndCompute(attention_flops=20e9, ring_bytes_per_s=0.5e9)
    for n in (2, 4, 8):
        found = auto_crossover(9, 3, 4, n, measured)
        assert found["share_threshold"] == pytest.approx(2 / 3)
        # Yang et al. 2024, Algorithm 1: pass-KV once T >= N*C*NKV*e / (2*NH*BW).
        assert found["pass_q_below_tokens"] == math.ceil(n * 20e9 * 3 * 4 / (2 * 9 * 0.5e9))
    # A huge crossover with a low share threshold (1/2): found without P ever looking small.
    slow_link = LinkAndCompute(attention_flops=1e15, ring_bytes_per_s=1e6)
    assert auto_crossover(8, 2, 4, 2, slow_link)["pass_q_below_tokens"] == 10**9
    assert auto_crossover(9, 3, 4, 1, measured)["pass_q_below_tokens"] == 1  # never pass-Q
    fast_link = LinkAndCompute(attention_flops=1e6, ring_bytes_per_s=1e12)
    assert auto_crossover(32, 8, 2, 2, fast_link)["pass_q_below_tokens"] == 1


def test_head_counts_from_the_gguf_header_match_mx_load(embedded_model, tmp_path):
    import mlx.core as mx

    from spmd_cp.models.gguf_config import gguf_config

    tensors, meta = mx.load(embedded_model, return_metadata=True)
    config = gguf_config(meta, tensors)
    assert head_counts(embedded_model) == (config["num_attention_heads"],
                                           config["num_key_value_heads"]) == (9, 3)
    tiny = write_tiny_model(tmp_path / "tiny", "llama")
    assert head_counts(str(tiny)) == (8, 2)


# -- under mpiexec -------------------------------------------------------------------------
def test_doctor_two_ranks_agree_and_write_the_calibration(embedded_model, cache):
    env = {"SPMD_CP_CACHE": str(cache)}
    launch = run_cli(2, ["doctor", "--json"], env=env, timeout=240)
    summary = launch.last_json()
    assert summary["ranks"] == 2 and summary["ok"] and summary["problems"] == []
    with open(embedded_model, "rb") as f:
        expected = hashlib.sha256(f.read()).hexdigest()
    assert summary["model_checksum"] == [expected, expected]
    assert len(set(summary["pid"])) == 2
    assert all(len(summary[key]) == 2 for key in ("host", "mlx", "mpi_library", "blas"))
    assert all(rate > 0 for rate in summary["attention_flops"])
    calibration = summary["calibration"]
    assert calibration["source"] == "measured"
    assert calibration["ring_bytes_per_s"] > 0 and calibration["attention_flops"] > 0
    assert 0 < calibration["ring_latency_s"] < 1
    # The file the auto algorithm reads holds exactly what was reported.
    written = json.loads(open(calibration["file"]).read())
    assert os.path.dirname(calibration["file"]) == str(cache)
    assert written["ring_bytes_per_s"] == calibration["ring_bytes_per_s"]
    assert written["attention_flops"] == calibration["attention_flops"]
    assert summary["auto"]["num_heads"] == 9 and summary["auto"]["num_kv_heads"] == 3
    # Decode's in-graph collectives opened as --decode-comm auto would, and timed.
    graph = summary["decode_collectives"]
    assert graph["opened"] and graph["reason"].startswith("MLX"), graph
    assert 0 < graph["latency_s"] < 1
    assert f"decode collectives in MLX's graph: {graph['reason']}" in launch.stdout
    assert "written to " + calibration["file"] in launch.stdout
    assert "model checksum  " + expected in launch.stdout
    # The decode plan generate makes with the default flags, whole, with its reasons.
    plan = summary["decode_plan"]
    assert plan["layout"] in ("split", "replicated") and plan["transport"] in ("mpi", "mlx")
    assert set(plan["reasons"]) == {"layout", "step", "transport"}
    assert plan["reasons"]["layout"].startswith("auto: estimated per step"), plan
    assert len(plan["inputs"]["samples"]["collective_s"]) > 1
    assert f"decode plan for this model (default flags): {plan['layout']} layout" in launch.stdout
    # --kv-dtype auto settles on a half-precision cache where the step is native
    assert plan["kv_dtype"] == ("float16" if plan["step"] == "native" else "float32"), plan
    assert f"{plan['kv_dtype']} KV cache" in launch.stdout
    # Every thread of every rank under Linux's batch policy (runtime/scheduling.py).
    assert summary["scheduling"] == ["batch", "batch"]
    assert "scheduling      batch" in launch.stdout
    # Each rank's allocator (runtime/allocator.py) and its huge-page advice
    # (runtime/huge_pages.py): the re-exec onto OpenBLAS set them, on every rank alike.
    malloc, advice = summary["allocator"], summary["huge_pages"]
    assert len(advice) == 2 and advice[0] == advice[1], advice
    assert len(malloc) == 2 and malloc[0] == malloc[1], malloc
    assert malloc[0] == "glibc malloc"  # jemalloc only on request (runtime/allocator.py)
    # Whether decode reads quantized weights packed (models/quantized_shadows.py): every
    # rank alike, as its CPU allows.
    packed = summary["quantized_decode"]
    assert len(packed) == 2 and packed[0] == packed[1], packed
    assert packed[0].startswith(("on (", "not available (")), packed
    assert f"quantized decode {packed[0]}" in launch.stdout
    # Whether decode steps run natively (engine/decode/native_decode.py): every rank alike.
    native = summary["native_decode"]
    assert len(native) == 2 and native[0] == native[1], native
    assert native[0].startswith(("on (", "not available (")), native
    assert f"native decode   {native[0]}" in launch.stdout
    assert "allocator       glibc malloc" in launch.stdout
    if summary["blas_kind"][0] == "openblas" and huge_pages.system_mode() is not None:
        assert advice[0].startswith("glibc.malloc.hugetlb=1")
        assert advice[0].endswith(f"THP {huge_pages.system_mode()}")
        assert "huge pages      " + advice[0] in launch.stdout

    # Again: the calibration comes from the cache; --recalibrate measures and rewrites it.
    again = run_cli(2, ["doctor", "--json"], env=env, timeout=120).last_json()
    assert again["calibration"]["source"] == "cache"
    assert again["calibration"]["ring_bytes_per_s"] == calibration["ring_bytes_per_s"]
    fresh = run_cli(2, ["doctor", "--json", "--recalibrate"], env=env, timeout=120).last_json()
    assert fresh["calibration"]["source"] == "measured"
    assert json.loads(open(calibration["file"]).read())["ring_bytes_per_s"] == \
        fresh["calibration"]["ring_bytes_per_s"]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor_models")
    return [str(write_tiny_model(root / f"seed{seed}", "llama", seed)) for seed in (0, 1)]


def mpmd(first: list[str], second: list[str], env: dict, **kwargs):
    """`mpiexec -n 1 spmd-cp <first> : -n 1 spmd-cp <second>`: one job, two command lines."""
    assert MPIEXEC
    return run_ranks(1, SPMD_CP + first + [":", "-n", "1"] + SPMD_CP + second, env=env,
                     timeout=120, check=False, **kwargs)


def test_doctor_reports_rank_with_a_different_model_file(two_models, cache):
    first, second = two_models
    launch = mpmd(["doctor", "--model", first, "--json"], ["doctor", "--model", second],
                  env={"SPMD_CP_CACHE": str(cache)})
    assert launch.returncode == EXIT_MISMATCH, launch.stderr
    summary = launch.last_json()
    assert not summary["ok"] and summary["ranks"] == 2
    checksums = [model_checksum(first), model_checksum(second)]
    assert summary["model_checksum"] == checksums and checksums[0] != checksums[1]
    assert "MISMATCH" in launch.stdout
    assert f"model checksum differs: rank 1 (host {summary['host'][1]}) has " \
           f"{checksums[1][:16]}..., rank 0 has {checksums[0][:16]}..." in launch.stdout
    # The measurements still ran: the report is complete even when it fails.
    assert summary["calibration"]["ring_bytes_per_s"] > 0


def test_doctor_reports_rank_missing_the_model(two_models, tmp_path, cache):
    missing = str(tmp_path / "not-there")
    launch = mpmd(["doctor", "--model", two_models[0]], ["doctor", "--model", missing],
                  env={"SPMD_CP_CACHE": str(cache)})
    assert launch.returncode == EXIT_MISMATCH, launch.stderr
    assert "model unusable on rank 1" in launch.stdout
    assert f"model not found: {missing}" in launch.stdout


@needs_c_helpers
def test_doctor_warns_where_the_sgemv_forward_did_not_build(cache):
    """A compiler that fails (and an empty cache): the ranks run on OpenBLAS without the
    matrix-vector forward, and doctor says so per rank, with why; the decode collectives
    fall back to the ring backend, named too. (Also: SPMD_CP_SCHED=default leaves the
    threads under Linux's default policy, SPMD_CP_HUGE_PAGES=off malloc as it is.)"""
    launch = run_cli(2, ["doctor", "--json"], env={"CC": shutil.which("false"),
                                                   "SPMD_CP_SCHED": "default",
                                                   "SPMD_CP_HUGE_PAGES": "off"}, timeout=120)
    summary = launch.last_json()
    assert summary["scheduling"] == ["other", "other"]
    if huge_pages.system_mode() is not None:
        assert summary["huge_pages"] == [
            f"not advised (SPMD_CP_HUGE_PAGES=off), THP {huge_pages.system_mode()}"] * 2
    assert summary["ok"] and summary["gemv_forward"] == [False, False]
    assert summary["quantized_decode"] == [
        "not available (needs the sgemv forward, built and preloaded on Linux)"] * 2
    assert summary["native_decode"] == ["not available (false failed: (no output))"] * 2
    skipped = [w for w in summary["warnings"] if "no sgemv forward: false failed" in w]
    assert [w.split(":")[0] for w in skipped] == ["rank 0 (" + summary["host"][0] + ")",
                                                  "rank 1 (" + summary["host"][1] + ")"]
    graph = summary["decode_collectives"]
    assert graph["opened"] and graph["reason"].startswith("MLX ring backend"), graph
    assert "not MPI: rank 0: building the MPI ABI adapter failed" in graph["reason"]
