"""benchmarks/gpu_check.py's flow on the CPU at tiny sizes (--device gpu: the
GPU path's fused attention and model-dtype cache), so that the check a lent GPU runs in
its few minutes cannot be broken while no GPU is at hand; with --remedies, the runs
that test the first H100 run's remedies too. Its figures are checked for
what the CPU can promise: the paths that merge nothing equal mlx-lm's forward. Its
exactness step runs for the bf16 model only: the 4-bit model's scores on this path are
tests/test_gpu_path.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RANK_ENV

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, **RANK_ENV}
    cmd = [sys.executable, str(SCRIPT), "--shape", "tiny", "--sizes", "96", "--exact-tokens",
           "64", "--max-tokens", "3", "--exact-models", "bf16", "--out", str(out),
           "--run-timeout", "120", "--device", "gpu", "--remedies"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"gpu_check did not finish in 500 s:\n{error.stderr}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "gpu_check.json").read_text())
    data["_markdown"] = (out / "gpu_check.md").read_text()
    return data


def test_every_run_measured(check):
    assert check["failures"] == [] and check["skipped"] == []
    (row,) = check["speed"]
    for run in ("mlx-lm", "spmd-cp N=1", "spmd-cp N=1 --prefill-chunk 0", "spmd-cp N=2",
                "spmd-cp N=2 --attention-kernel tiled"):
        r = row[run]
        assert r["prompt_tokens"] == 96 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert len(r["peak_mem_bytes"]) == (2 if "N=2" in run else 1)
        if run != "mlx-lm":  # the forecast spmd-cp checked the prompt against
            assert r["memory_forecast"]["weights_bytes"] > 0
            assert r["memory_forecast"]["activations_bytes"] > 0
    assert row["spmd-cp N=1"]["kv_dtype"] == "bfloat16"
    # Greedy continuations of the bf16 model on one rank: mlx-lm's own tokens.
    assert row["spmd-cp N=1"]["token_ids"] == row["mlx-lm"]["token_ids"]
    assert row["spmd-cp N=1 --prefill-chunk 0"]["token_ids"] == row["mlx-lm"]["token_ids"]


def test_exactness_rows(check):
    rows = {(e["model"], e["run"]): e for e in check["exactness"]}
    # mlx-lm against its float32 evaluation, N=1 vs mlx-lm, three algorithms at N=2, the
    # rings again with float32 partials
    assert len(rows) == 7
    scale = rows[("bf16", "mlx-lm vs float32")]["max_dlogprob"]
    assert 0 < scale < 0.5 and "vs_float32" not in rows[("bf16", "mlx-lm vs float32")]
    # Nothing merged: the same computation as mlx-lm's forward, position by position.
    for run in ("N=1 vs mlx-lm", "N=2 allgather-kv vs N=1"):
        assert rows[("bf16", run)]["max_dlogprob"] == 0.0, run
        assert rows[("bf16", run)]["argmax_agreement"] == 1.0
        assert rows[("bf16", run)]["positions"] == 63
        # mlx-lm's own scores, so exactly as far from the float32 evaluation as mlx-lm
        assert rows[("bf16", run)]["vs_float32"]["max_dlogprob"] == scale, run
    # The rings merge half-precision partials; on the CPU MLX's attention rounds scores
    # to bf16 as well (see test_gpu_path), so only a loose bound holds here.
    for run in ("pass-kv", "pass-q", "pass-kv tiled", "pass-q tiled"):
        assert rows[("bf16", f"N=2 {run} vs N=1")]["max_dlogprob"] < 0.2
        assert rows[("bf16", f"N=2 {run} vs N=1")]["positions"] == 63
        assert rows[("bf16", f"N=2 {run} vs N=1")]["vs_float32"]["max_dlogprob"] < 0.2
    assert "| max |dlogprob| vs float32 |" in check["_markdown"]
    assert "| forecast GiB (MLX arrays) |" in check["_markdown"]
    assert "| 96 | spmd-cp N=2 |" in check["_markdown"]
    assert "| 96 | spmd-cp N=1 --prefill-chunk 0 |" in check["_markdown"]
    assert "| 96 | spmd-cp N=2 --attention-kernel tiled |" in check["_markdown"]


def test_decode_probe_rows(check):
    """One rank's decode step timed apart, spmd-cp beside mlx-lm, at the prompt size."""
    (row,) = check["decode_probe"]
    assert row["context"] == 96
    for name in ("mlx-lm", "spmd-cp"):
        assert 0 < row[name]["build_ms"] <= row[name]["step_ms"]
        assert 0 < row[name]["eval_ms"] <= row[name]["step_ms"]
    assert row["spmd-cp"]["decode_step"] == "graph"  # the GPU path's step
    assert "| 96 | spmd-cp |" in check["_markdown"]
