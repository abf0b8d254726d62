"""The benchmarks' runner (benchmarks/benchlib.run_json): a run past its limit ends with
its whole process tree and a one-line reason, never a benchmark left waiting on it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import benchlib  # noqa: E402


def test_a_run_past_its_limit_ends_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    # The child the command leaves running stands in for a rank an mpiexec started.
    script = f"sleep 60 & echo $! > {marker}; wait"
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"did not finish in 2 s"):
        benchlib.run_json(["bash", "-c", script], timeout=2, quiet_wait=0)
    assert time.perf_counter() - start < 20
    child = marker.read_text().strip()
    alive = subprocess.run(["ps", "-o", "stat=", "-p", child], capture_output=True, text=True)
    assert alive.stdout.strip() in ("", "Z"), f"child {child} still running: {alive.stdout}"


def test_a_run_that_finishes_returns_its_last_json_line():
    result = benchlib.run_json(["bash", "-c", "echo noise; echo '{\"tok_s\": 12.5}'"],
                               quiet_wait=0)
    assert result["tok_s"] == 12.5 and result["_returncode"] == 0


def test_a_recorded_command_names_no_absolute_path():
    # Result files record the command to rerun: another checkout beside this one must be
    # recorded as ../NAME, not as the directory one machine had it in.
    root = benchlib.ROOT
    sibling = root.parent / "spmd-cp-base"
    argv = ["--trees", f"base={sibling}", f"this={root}", "--baseline",
            str(sibling / ".venv/bin/spmd-cp"), "--compare-env", f"PYTHONPATH={sibling}",
            "--rounds", "2", "--name", "a b"]
    command = benchlib.command_line("bench_generate.py", argv)
    assert command == ("python benchmarks/bench_generate.py --trees base=../spmd-cp-base "
                       "this=. --baseline ../spmd-cp-base/.venv/bin/spmd-cp --compare-env "
                       "PYTHONPATH=../spmd-cp-base --rounds 2 --name 'a b'")
    assert benchlib.from_root(root / "benchmarks" / "results") == "benchmarks/results"
