"""Decode's collectives inside MLX's graph (runtime/graph_comm.py) on real ranks, against
numpy; and the same greedy tokens through them, through MPI and on one rank."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from conftest import TESTS, run_cli, run_ranks


def graph_records(n: int, tmp_path, mode: str = "auto", env: dict | None = None) -> list:
    out = tmp_path / f"graph-{n}-{mode}.json"
    run_ranks(n, [sys.executable, str(TESTS / "graph_comm_driver.py"), str(out), mode],
              timeout=120, env=env)
    return json.loads(out.read_text())


@pytest.mark.parametrize("n", [2, 3])
def test_graph_collectives_equal_numpy_on_every_rank(n, tmp_path):
    """Uneven gathers (rank r contributes r + 1 rows), stack, sums (small ones through
    all_gather, with and without a leading axis of 1; a 1 MiB one through the ring's
    all_sum) and max: every rank gets exactly what numpy computes from all ranks' inputs
    (shapes included)."""
    sys.path.insert(0, str(TESTS))
    from graph_comm_driver import contribution

    records = graph_records(n, tmp_path)
    inputs = [contribution(r) for r in range(n)]
    rows = np.concatenate([np.moveaxis(i["rows"], 1, 2) for i in inputs], axis=-1)
    expected = {
        "allgather_rows": rows,
        "gather_rows": np.concatenate([i["vector"] for i in inputs]),
        "allgather_stack": np.stack([i["block"] for i in inputs]),
        "sum": np.sum([i["block"] for i in inputs], axis=0),
        "wide_sum": np.sum([i["wide"] for i in inputs], axis=0),
        "row_sum": np.sum([i["row"] for i in inputs], axis=0),
        "max": np.max([i["block"] - r for r, i in enumerate(inputs)], axis=0),
    }
    for rank, record in enumerate(records):
        assert record["opened"], record["reason"]
        assert "ring" in record["reason"]
        for name, value in expected.items():
            np.testing.assert_array_equal(np.array(record["results"][name]), value,
                                          err_msg=f"{name} on rank {rank}")
        assert record["bytes_sent"] > 0  # counted like Comm's collectives


def test_graph_collectives_stay_closed_where_asked_or_on_the_gpu_path(tmp_path):
    """--decode-comm mpi never opens them; the GPU path (forced here on the CPU) keeps
    MPI, and says why on every rank."""
    assert all(not r["opened"] and r["reason"] == "--decode-comm mpi"
               for r in graph_records(2, tmp_path, "mpi"))
    gpu = graph_records(2, tmp_path, "auto", env={"SPMD_CP_PATH": "gpu"})
    assert all(not r["opened"] and "GPU path" in r["reason"] for r in gpu)


def test_decode_through_graph_collectives_gives_the_tokens_of_mpi_and_of_one_rank(
        tmp_path, tiny_models):
    """Greedy tokens with the split step and with the replicated one, collectives in the
    graph or through MPI, equal one rank's; the log says which collectives ran."""
    model = tiny_models["llama"]
    prompt = ["--model", model, "--prompt", "the quick brown fox " * 40, "--max-tokens", "12",
              "--json", "--temp", "0"]
    single = run_cli(1, ["generate", *prompt]).last_json()["token_ids"]
    for tp in ("on", "off"):
        for comm in ("mlx", "mpi"):
            launch = run_cli(2, ["generate", *prompt, "--decode-tp", tp, "--decode-comm", comm])
            assert launch.last_json()["token_ids"] == single, (tp, comm)
            said = "in MLX's graph" if comm == "mlx" else "MPI"
            assert f"decode collectives: {said}" in launch.stderr


def test_decode_comm_mlx_where_it_cannot_open_is_one_line(tmp_path, tiny_models):
    launch = run_cli(2, ["generate", "--model", tiny_models["llama"], "--prompt", "hello",
                         "--max-tokens", "2", "--decode-comm", "mlx"],
                     env={"SPMD_CP_PATH": "gpu"}, check=False)
    assert launch.returncode == 2, launch.stderr
    errors = [line for line in launch.stderr.splitlines() if "error" in line]
    assert errors and "--decode-comm mlx" in errors[0] and "GPU path" in errors[0]
