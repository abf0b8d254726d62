"""CP x TP grids (``--tp``): every rank holds its slices of the weights, TP groups sum their
partial products, CP groups split the sequence; scores and greedy tokens equal mlx-lm's
unmodified forward (float32), at N = 2 as TP 2 and at N = 4 as CP 2 x TP 2 under every CP
algorithm, and at N = 4 as TP 4 where T exceeds the KV heads."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_refused, run_cli, run_ranks, write_tiny_model
from test_families import FAMILIES, reference

from spmd_cp.cli.doctor_checks import grid_report, grid_warnings
from spmd_cp.engine.weights.tensor_groups import HeadShare, head_shares

TESTS = Path(__file__).parent
DRIVER = [sys.executable, str(TESTS / "grid_driver.py")]
sys.path.insert(0, str(TESTS))
from grid_driver import SEED  # noqa: E402

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
CP_ALGOS = ["pass-kv", "pass-q", "allgather-kv"]
LONG, SHORT = 1500, 40  # prompt tokens: the embedded model's, the tiny models'


@pytest.fixture(scope="module")
def grid_models(embedded_model, tiny_models, tiny_gemma3_models, tiny_variant_models,
                tmp_path_factory) -> dict:
    """{name: [path, prompt length]}: the embedded SmolLM2 (9 query heads over 3 KV heads:
    TP 2 deals them 2 + 1), and tiny models of every family's particulars: q/k norms
    (qwen3), Gemma 3's sliding windows and sandwich norms, q/k/v biases and an untied head
    (qwen2), fused q|k|v and gate|up (phi3), experts (qwen3_moe, mixtral)."""
    root = tmp_path_factory.mktemp("grid_families")
    families = {name: str(write_tiny_model(root / name, FAMILIES[name]["model_type"], seed=5,
                                           extra_config=FAMILIES[name]))
                for name in ("phi3", "qwen3_moe", "mixtral")}
    tiny = {**tiny_models, "gemma3": tiny_gemma3_models["gemma3_text"],
            "qwen2": tiny_variant_models["qwen2"], **families}
    return {"smollm2": [embedded_model, LONG], **{k: [v, SHORT] for k, v in tiny.items()}}


@pytest.fixture(scope="module")
def grids(grid_models, tmp_path_factory) -> dict:
    """{(N, T): the driver's results}: TP 2 alone, CP 2 x TP 2 under every algorithm, TP 4
    over the tiny Llama's 2 KV heads, and one rank's run of the embedded model (its
    reference: mlx-lm's CPU forward takes minutes over 1,500 tokens)."""
    work = tmp_path_factory.mktemp("grid-runs")
    runs = {(1, 1): ({"smollm2": grid_models["smollm2"]}, ["pass-kv"]),
            (2, 2): (grid_models, ["pass-kv"]), (4, 2): (grid_models, CP_ALGOS),
            (4, 4): ({"llama": grid_models["llama"]}, ["pass-q"])}
    out = {}
    for (n, tp), (models, algos) in runs.items():
        path = work / f"grid-{n}-{tp}.json"
        run_ranks(n, DRIVER + [json.dumps(models), str(tp), ",".join(algos), str(path)],
                  timeout=900)
        out[(n, tp)] = json.loads(path.read_text())["results"]
    return out


@pytest.mark.parametrize("name", ["smollm2", "llama", "qwen3", "gemma3", "qwen2", "phi3",
                                  "qwen3_moe", "mixtral"])
def test_grids_score_and_decode_as_mlx_lm(grid_models, grids, name):
    """|dlogprob| <= 1e-4 and the same greedy tokens at TP 2 and CP 2 x TP 2 (each algo),
    and at TP 4 where the model has fewer KV heads than ranks, as mlx-lm's forward (the
    tiny models) or one rank's run (the embedded model)."""
    if name == "smollm2":
        alone = grids[(1, 1)][name]["algos"]["pass-kv"]
        scored, tokens = alone["logprob"], alone["greedy"]
    else:
        scored, tokens = reference(*grid_models[name], SEED)
    checked = 0
    for (n, tp), results in grids.items():
        if name not in results or tp == 1:
            continue
        for algo, run in results[name]["algos"].items():
            np.testing.assert_allclose(run["logprob"], scored, **TOLERANCE,
                                       err_msg=f"{name} N={n} --tp {tp} {algo}")
            assert run["greedy"] == tokens, (name, n, tp, algo)
            assert run["step"] == "mlx", (name, n, tp, algo)  # MLX's step sums the slices
            checked += 1
    assert checked == (1 + len(CP_ALGOS) + (name == "llama"))


def test_each_rank_holds_its_share_of_the_weights(grids):
    """At TP 2 every rank of the embedded model holds at most 0.6x one rank's weights, and
    held at most 0.7x of them while it loaded (its slices and one layer whole, never the
    model); its KV heads are dealt 2 + 1, the tiny Llama's 2 KV heads over TP 4 one to
    each pair of ranks."""
    whole = grids[(1, 1)]["smollm2"]["weights"][0]
    for key in ((2, 2), (4, 2)):
        smollm2 = grids[key]["smollm2"]
        assert max(smollm2["weights"]) <= 0.6 * whole, (key, smollm2["weights"], whole)
        assert max(smollm2["load_peak"]) <= 0.7 * whole, (key, smollm2["load_peak"], whole)
        assert smollm2["kv_heads"] == [2, 1] * (key[0] // 2)
    assert grids[(4, 4)]["llama"]["kv_heads"] == [1, 1, 1, 1]


def test_head_shares_keep_each_kv_head_with_its_queries():
    """T <= KV heads: KV heads dealt in runs with their query heads; T a multiple of the KV
    heads dividing each group: one KV head copied to the ranks sharing its queries; else
    refused, naming the counts."""
    assert head_shares(9, 3, 2) == [HeadShare(0, 6, 0, 2), HeadShare(6, 9, 2, 3)]
    assert head_shares(8, 2, 4) == [HeadShare(0, 2, 0, 1), HeadShare(2, 4, 0, 1),
                                    HeadShare(4, 6, 1, 2), HeadShare(6, 8, 1, 2)]
    assert head_shares(8, 8, 8)[3] == HeadShare(3, 4, 3, 4)
    with pytest.raises(ValueError, match="4 tensor-parallel ranks cannot share 9 query heads "
                                         "over 3 KV heads"):
        head_shares(9, 3, 4)


def test_doctor_names_a_tp_group_across_hosts():
    """A hostfile of one slot a host puts ranks 0 and 1 on two hosts: doctor's grid says
    so; two slots a host keep each group on one."""
    assert grid_report(["a", "a", "b", "b"], 2)["tp_groups_across_hosts"] == []
    across = grid_report(["a", "b", "a", "b"], 2)
    assert across["tp_groups"] == [[0, 1], [2, 3]] and across["cp"] == 2
    assert across["tp_groups_across_hosts"] == [[0, 1], [2, 3]]
    assert "ranks 0, 1 form a tensor-parallel group across hosts" in grid_warnings(across)[0]
    assert grid_warnings(grid_report(["a", "a"], 3)) == [
        "--tp 3 does not divide the 2 ranks into tensor-parallel groups"]


def test_generate_on_a_grid_reports_it(embedded_model, tmp_path):
    """``generate --tp 2 --keep-quantized`` at N = 4 (the CLI users run): the greedy answer
    of one rank, at most 0.6x its weights a rank, and ``tp``, ``cp``, per-rank weight and
    KV bytes in --json; its prompt cache continued on the same grid answers as one rank's
    continued; one line for a cache of another grid, a --tp that does not divide the ranks
    or a setting it does not combine with."""
    args = ["generate", "--max-tokens", "12", "--json", "--kv-dtype", "float32"]
    first = ["--prompt", "Name three colours of the rainbow.", "--save-cache"]
    then = ["--prompt", "And three fruits?", "--load-cache"]
    one = run_cli(1, args + first + [str(tmp_path / "one")]).last_json()
    # the packed Q4_1 file's matrices read in place (one rank) against MLX's quantized
    # form of the same blocks, cut: 1/T of the file a rank
    on_grid = args + ["--tp", "2", "--keep-quantized"]
    grid = run_cli(4, on_grid + first + [str(tmp_path / "grid")]).last_json()
    assert grid["token_ids"] == one["token_ids"]
    assert (grid["tp"], grid["cp"], grid["ranks"]) == (2, 2, 4)
    assert max(grid["model_bytes"]) <= 0.6 * one["model_bytes"][0]
    assert grid["kv_cache_bytes"][0] == 2 * grid["kv_cache_bytes"][1]  # 2 KV heads and 1
    assert grid["decode_step"] == "mlx"
    meta = json.loads((tmp_path / "grid" / "meta.json").read_text())
    assert (meta["cp_size"], meta["tp_size"], len(meta["shard_sha256"])) == (2, 2, 4)
    again = run_cli(4, on_grid + then + [str(tmp_path / "grid")]).last_json()
    alone = run_cli(1, args + then + [str(tmp_path / "one")]).last_json()
    assert again["token_ids"] == alone["token_ids"]
    assert again["prompt_tokens_reused"] == alone["prompt_tokens_reused"] > 0
    for n, extra, message in [
            (2, then + [str(tmp_path / "grid")], "was made on 4 ranks as --tp 2; this job has "
             "2 as --tp 1 (run with mpiexec -n 4 and --tp 2)"),
            (2, ["--tp", "3"], "--tp 3 does not divide the 2 ranks"),
            (2, ["--tp", "2", "--decode-step", "native"],
             "--tp 2 does not combine with --decode-step native")]:
        assert_refused(n, args + (extra if "--prompt" in extra else
                                  extra + ["--prompt", "Hi"]), message)


def test_serve_on_a_grid_answers_as_one_rank(tmp_path):
    """``serve --tp 2`` (N = 2) through the openai client: one rank's greedy answer, and
    again from its resident cache."""
    from test_serve import free_port, launch_server

    question = ["--prompt", "What is the capital of France?"]
    alone = run_cli(1, ["generate", *question, "--max-tokens", "12", "--json", "--kv-dtype",
                        "float32"]).last_json()
    server = launch_server(free_port(), tmp_path / "server.log",
                           ["--tp", "2", "--kv-dtype", "float32"])
    try:
        server.wait_healthy()
        for _ in range(2):
            reply = server.client().chat.completions.create(
                model="any", messages=[{"role": "user", "content": question[1]}],
                max_tokens=12, temperature=0)
            assert reply.choices[0].message.content == alone["text"], server.log()
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)


def test_batch_on_a_grid_decodes_jobs_together_as_one_rank(tmp_path):
    """``batch --tp 2 --max-batch 2`` at N = 4: three jobs after one document, decoded two
    at a time across CP 2 x TP 2, answer as one rank's jobs one after another; rank 0
    says what ``--keep-quantized`` would hold."""
    (tmp_path / "doc.txt").write_text("The GNU General Public License is a free, copyleft "
                                      "license for software and other kinds of works. " * 12)
    questions = [("a", "What is this?", 10), ("b", "Who wrote it?", 10), ("c", "Is it free?", 6)]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": i, "prefix_file": "doc.txt", "prompt": q,
                                        "max_tokens": n, "ignore_eos": True}) + "\n"
                            for i, q, n in questions))
    answers = {}
    for n, extra in ((1, []), (4, ["--tp", "2", "--max-batch", "2"])):
        out = tmp_path / f"out-{n}.jsonl"
        launch = run_cli(n, ["batch", "--jobs", str(jobs), "--output", str(out), "--json",
                             "--kv-dtype", "float32", *extra])
        summary = launch.last_json()
        answers[n] = {job["id"]: job["text"] for job in map(json.loads, out.open())}
    assert answers[4] == answers[1] and len(answers[1]) == 3
    assert (summary["tp"], summary["cp"], summary["max_batch"]) == (2, 2, 2)
    assert summary["batch_sizes"].get("2", 0) > 0
    # the quantized file held as float32 slices: rank 0 names what --keep-quantized holds
    assert "--tp 2: each rank holds 1/2 of the float32 weights" in launch.stderr
    assert "--keep-quantized would hold 1/2 of 0.09 GB" in launch.stderr


def test_the_gpu_paths_arithmetic_on_a_grid_scores_as_one_rank(tmp_path):
    """``score --device gpu --tp 2`` (the GPU path's dtypes and fused attention, run on
    this CPU) against one rank's ``--device gpu``: the same logprobs within 1e-4."""
    (tmp_path / "doc.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    scored = {}
    for n, extra in ((1, []), (2, ["--tp", "2"])):
        out = tmp_path / f"scores-{n}.jsonl"
        run_cli(n, ["score", "--text-file", str(tmp_path / "doc.txt"), "--output", str(out),
                    "--device", "gpu", *extra])
        scored[n] = [json.loads(line)["logprob"] for line in out.open()]
    assert len(scored[2]) == len(scored[1]) >= 300
    np.testing.assert_allclose(scored[2], scored[1], **TOLERANCE)
