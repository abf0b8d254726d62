"""--trace writes one Chrome trace merging every rank; trace-summary reads it back."""

from __future__ import annotations

import json
import subprocess

from conftest import SPMD_CP, run_cli


def test_two_rank_trace_is_valid_chrome_json_with_both_ranks(tiny_models, tmp_path):
    trace = tmp_path / "trace.json"
    prompt = tmp_path / "p.txt"
    prompt.write_text("The history of the city is long. " * 10)
    run_cli(2, ["generate", "--model", tiny_models["llama"], "--prompt-file", str(prompt),
                "--max-tokens", "4", "--cp-algo", "pass-kv", "--decode-tp", "on",
                "--trace", str(trace)])
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in complete)
    assert {e["pid"] for e in complete} == {0, 1}
    for rank in (0, 1):
        mine = {e["cat"] for e in complete if e["pid"] == rank}
        assert {"prefill", "decode", "layer", "wait", "transfer"} <= mine
        layers = [e for e in complete if e["pid"] == rank and e["cat"] == "layer"]
        assert len(layers) == 3 * (1 + 3)  # 3 layers: one prefill chunk + 3 decode steps
    # Ring transfers run on the communication thread, beside the compute thread.
    assert {e["tid"] for e in complete if e["cat"] == "transfer"} == {1}
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}

    summary = subprocess.run(SPMD_CP + ["trace-summary", str(trace)], capture_output=True,
                             text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[0].startswith("rank 0:") and lines[1].startswith("rank 1:")
    assert "compute" in lines[0] and "waiting" in lines[0]
    assert lines[-1].startswith("slowest rank: ")
