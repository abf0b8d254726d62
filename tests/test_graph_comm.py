"""Decode's collectives inside MLX's graph (runtime/graph_comm.py) on real ranks, against
numpy, over MLX's MPI backend (through runtime/mpi_abi.py's adapter) and its ring
backend; and the same greedy tokens through them, through MPI and on one rank."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from conftest import C_HELPERS_BUILD, TESTS, needs_c_helpers, run_cli, run_ranks


def graph_records(n: int, tmp_path, mode: str = "auto", env: dict | None = None,
                  backend: str = "auto", device: str = "auto") -> list:
    out = tmp_path / f"graph-{n}-{mode}.json"
    run_ranks(n, [sys.executable, str(TESTS / "graph_comm_driver.py"), str(out), mode,
                  backend, device], timeout=120, env=env)
    return json.loads(out.read_text())


BACKENDS = [pytest.param("mpi", "MLX's MPI backend over MPICH", marks=needs_c_helpers),
            ("ring", "MLX ring backend")]


@pytest.mark.parametrize("backend,described", BACKENDS)
@pytest.mark.parametrize("n", [2, 3])
def test_graph_collectives_equal_numpy_on_every_rank(n, backend, described, tmp_path):
    """Uneven gathers (rank r contributes r + 1 rows), stack, sums (small ones through
    all_gather, with and without a leading axis of 1; a 1 MiB one through all_sum), a
    row summed onto a residual (in the graph and through Comm) and max: every rank gets
    exactly what numpy computes from all ranks' inputs (shapes included), over either
    backend; and a send to the next rank arrives."""
    sys.path.insert(0, str(TESTS))
    from graph_comm_driver import RESIDUAL, contribution

    records = graph_records(n, tmp_path, env={"SPMD_CP_CACHE": str(tmp_path)},
                            backend=backend)
    inputs = [contribution(r) for r in range(n)]
    rows = np.concatenate([np.moveaxis(i["rows"], 1, 2) for i in inputs], axis=-1)
    expected = {
        "allgather_rows": rows,
        "gather_rows": np.concatenate([i["vector"] for i in inputs]),
        "allgather_stack": np.stack([i["block"] for i in inputs]),
        "sum": np.sum([i["block"] for i in inputs], axis=0),
        "wide_sum": np.sum([i["wide"] for i in inputs], axis=0),
        "row_sum": np.sum([i["row"] for i in inputs], axis=0),
        "row_onto": RESIDUAL + np.sum([i["row"] for i in inputs], axis=0),
        "row_onto_host": RESIDUAL + np.sum([i["row"] for i in inputs], axis=0),
        "max": np.max([i["block"] - r for r, i in enumerate(inputs)], axis=0),
    }
    for rank, record in enumerate(records):
        np.testing.assert_array_equal(np.array(record["results"]["received"]),
                                      inputs[(rank - 1) % n]["row"])
        assert record["opened"], record["reason"]
        assert record["reason"].startswith(described), record["reason"]
        for name, value in expected.items():
            np.testing.assert_array_equal(np.array(record["results"][name]), value,
                                          err_msg=f"{name} on rank {rank}")
        assert record["bytes_sent"] > 0  # counted like Comm's collectives


@needs_c_helpers
def test_auto_takes_the_mpi_adapter_and_falls_back_to_the_ring_when_it_cannot_build(
        tmp_path):
    """``auto`` opens MLX's MPI backend where the adapter builds, and the ring backend,
    naming why not MPI, where it does not (a compiler that fails: CC=false)."""
    cache = {"SPMD_CP_CACHE": str(tmp_path / "cache")}
    built = graph_records(2, tmp_path, env=cache)
    assert all(r["opened"] and r["reason"].startswith("MLX's MPI backend") for r in built)
    assert list((tmp_path / "cache" / "mpi-abi").glob("adapter-*.so"))  # kept for next time
    failing = graph_records(2, tmp_path, env={"SPMD_CP_CACHE": str(tmp_path / "empty"),
                                              "CC": shutil.which("false")})
    for record in failing:
        assert record["opened"] and record["reason"].startswith("MLX ring backend")
        assert "not MPI: rank 0: building the MPI ABI adapter failed" in record["reason"]


def test_graph_collectives_stay_closed_where_asked_or_on_the_gpu_path(tmp_path):
    """--decode-comm mpi never opens them; the GPU path (forced here on the CPU) keeps
    MPI, and says why on every rank."""
    assert all(not r["opened"] and r["reason"] == "--decode-comm mpi"
               for r in graph_records(2, tmp_path, "mpi"))
    gpu = graph_records(2, tmp_path, "auto", device="gpu")
    assert all(not r["opened"] and "GPU path" in r["reason"] for r in gpu)


def test_decode_through_graph_collectives_gives_the_tokens_of_mpi_and_of_one_rank(
        tmp_path, tiny_models):
    """MLX's decode step (--decode-step graph: the native step has no graph):
    greedy tokens with the split step and with the replicated one, collectives in the
    graph or through MPI, equal one rank's; the decode plan says which collectives ran."""
    model = tiny_models["llama"]
    prompt = ["--model", model, "--prompt", "the quick brown fox " * 40, "--max-tokens", "12",
              "--json", "--temp", "0"]
    single = run_cli(1, ["generate", *prompt]).last_json()["token_ids"]
    backends = ["ring"] + (["mpi"] if C_HELPERS_BUILD else [])
    runs = [("on", "mpi", None), ("off", "mpi", None)]
    runs += [(tp, "mlx", backend) for tp in ("on", "off") for backend in backends]
    for tp, comm, backend in runs:
        launch = run_cli(2, ["generate", *prompt, "--decode-tp", tp, "--decode-comm", comm,
                             "--decode-step", "graph", "--graph-backend", backend or "auto"])
        summary = launch.last_json()
        assert summary["decode_step"] == "mlx"
        assert summary["token_ids"] == single, (tp, comm, backend)
        plan = summary["decode_plan"]
        assert (plan["step"], plan["transport"], plan["layout"]) == (
            "graph", comm, {"on": "split", "off": "replicated"}[tp]), plan
        said = {"mpi": "--decode-comm mpi", "mlx": "MLX"}[comm]
        assert plan["reasons"]["transport"].startswith(said), plan
        assert plan["reasons"]["step"] == "rank 0: --decode-step graph", plan
        if backend:
            assert {"mpi": "MPI backend", "ring": "ring backend"}[backend] in launch.stderr


@pytest.mark.parametrize("variable, value", [("SPMD_CP_SCHED", "fifo"),
                                             ("SPMD_CP_HUGE_PAGES", "always"),
                                             ("SPMD_CP_ALLOCATOR", "tcmalloc")])
def test_a_runtime_variable_with_a_bad_value_is_one_line(tiny_models, variable, value):
    launch = run_cli(2, ["generate", "--model", tiny_models["llama"], "--prompt", "hello",
                         "--max-tokens", "2"], env={variable: value}, check=False)
    assert launch.returncode == 2, launch.stderr
    errors = [line for line in launch.stderr.splitlines() if "error" in line]
    assert errors and f"{variable}='{value}'" in errors[0], launch.stderr


def test_decode_comm_mlx_where_it_cannot_open_is_one_line(tmp_path, tiny_models):
    launch = run_cli(2, ["generate", "--model", tiny_models["llama"], "--prompt", "hello",
                         "--max-tokens", "2", "--decode-comm", "mlx", "--device", "gpu"],
                     check=False)
    assert launch.returncode == 2, launch.stderr
    errors = [line for line in launch.stderr.splitlines() if "error" in line]
    assert errors and "--decode-comm mlx" in errors[0] and "GPU path" in errors[0]


def test_auto_keeps_the_faster_of_graph_and_mpi4py_collectives(tiny_models):
    """``--decode-comm auto`` over the ring with 4 ranks on this machine's cores: where
    its collective costs more than mpi4py's (the ring's socket threads on oversubscribed
    cores: milliseconds), decode takes mpi4py and logs both timings, the faster first;
    either way the tokens are one rank's."""
    import re

    prompt = ["generate", "--model", tiny_models["llama"], "--prompt", "the quick brown fox " * 20,
              "--max-tokens", "6", "--json", "--temp", "0"]
    single = run_cli(1, prompt).last_json()["token_ids"]
    # MLX's decode step: the native one takes MPI's collectives without timing the graph's
    launch = run_cli(4, prompt + ["--decode-step", "graph", "--graph-backend", "ring"],
                     timeout=240)
    assert launch.last_json()["token_ids"] == single
    said = launch.last_json()["decode_plan"]["reasons"]["transport"]
    timed = re.match(r"(\d+) us per collective through mpi4py against (\d+) us in "
                     r"MLX's graph \(MLX ring backend", said)
    if timed:
        assert int(timed.group(1)) <= int(timed.group(2)), said  # rounded to us
        assert launch.last_json()["decode_comm"] == "mpi"
    else:
        assert said.startswith("MLX ring backend"), said
