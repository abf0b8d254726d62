"""Attention-FFN disaggregation (``--afd A:F``): attention ranks hold the KV and run
attention context-parallel, FFN ranks hold the MLPs or experts and no KV. Scores and
greedy tokens equal mlx-lm's unmodified forward (float32) for a mixture of 8 experts
(top-2, one dense layer among them), Mixtral's router and a dense Llama, at N = 3 as
``2:1`` and N = 4 as ``2:2`` under every CP algorithm; through the CLI, generate,
score, batch, serve and prompt caches answer as one rank."""

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

from spmd_cp.cli.doctor_checks import afd_report
from spmd_cp.cli.doctor_report import grid_lines
from spmd_cp.runtime.afd import AfdRoles, afd_obstacle, straggler_summary

TESTS = Path(__file__).parent
DRIVER = [sys.executable, str(TESTS / "afd_driver.py")]
sys.path.insert(0, str(TESTS))
from afd_driver import SEED  # noqa: E402

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
CP_ALGOS = ["pass-kv", "pass-q", "allgather-kv"]
LENGTH = 40
# 8 experts, 2 a token: at 2:2 each FFN rank holds 4
MIXTURES = {"qwen3_moe": {**FAMILIES["qwen3_moe"], "num_experts": 8},
            "mixtral": {**FAMILIES["mixtral"], "num_local_experts": 8}}


@pytest.fixture(scope="module")
def afd_models(tiny_models, tmp_path_factory) -> dict:
    """{name: [path, prompt length]}: the mixtures (Qwen3-MoE's router with a dense layer
    1, Mixtral's) and the tiny dense Llama."""
    root = tmp_path_factory.mktemp("afd_models")
    models = {name: str(write_tiny_model(root / name, extra["model_type"], seed=5,
                                         extra_config=extra))
              for name, extra in MIXTURES.items()}
    models["llama"] = tiny_models["llama"]
    return {name: [path, LENGTH] for name, path in models.items()}


@pytest.fixture(scope="module")
def afd_runs(afd_models, tmp_path_factory) -> dict:
    """{(N, spec): the driver's results}: 2:1 in two micro-batches, 2:2 in one and in
    three, each under every CP algorithm."""
    work = tmp_path_factory.mktemp("afd-runs")
    out = {}
    for n, spec, micro, algos in ((3, "2:1", 2, CP_ALGOS), (4, "2:2", 1, CP_ALGOS),
                                  (4, "2:2", 3, ["pass-kv"])):
        path = work / f"afd-{n}-{micro}.json"
        run_ranks(n, DRIVER + [json.dumps(afd_models), spec, ",".join(algos), str(micro),
                               str(path)], timeout=600)
        out[(n, spec, micro)] = json.loads(path.read_text())["results"]
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "llama"])
def test_afd_scores_and_decodes_as_mlx_lm(afd_models, afd_runs, name):
    """|dlogprob| <= 1e-4 and the same greedy tokens as mlx-lm's forward, at 2:1 and 2:2,
    every CP algorithm, one to three micro-batches; decode in MLX's step."""
    scored, tokens = reference(*afd_models[name], SEED)
    checked = 0
    for key, results in afd_runs.items():
        for algo, run in results[name]["algos"].items():
            np.testing.assert_allclose(run["logprob"], scored, **TOLERANCE,
                                       err_msg=f"{name} {key} {algo}")
            assert run["greedy"] == tokens, (name, key, algo)
            assert run["step"] == "mlx", (name, key, algo)
            checked += 1
    assert checked == 2 * len(CP_ALGOS) + 1


def test_ffn_ranks_hold_no_kv_and_attention_ranks_no_experts(afd_runs):
    """The sides partition the model: an attention rank holds everything but the
    feed-forward (a mixture's router stays), the FFN ranks the feed-forward between
    them (no embedding, head or attention), and each read only that, a layer at a time;
    only attention ranks hold KV. Bytes cross the
    link both ways, and each side names its slowest rank."""
    for (n, spec, micro), results in afd_runs.items():
        roles = AfdRoles.of(spec, n)
        for name, result in results.items():
            weights, whole = result["weights"], result["whole"]
            attention, ffn = weights[:roles.attention], weights[roles.attention:]
            assert len(set(attention)) == 1, (name, spec, weights)
            assert attention[0] + sum(ffn) == whole, (name, spec, weights, whole)
            if result["experts"]:
                assert attention[0] <= whole - result["experts"], (name, weights)
                assert sum(ffn) >= result["experts"], (name, weights)
            # while loading, a rank held its part and the layer being cut, never the model
            for held, peak in zip(weights, result["load_peak"]):
                assert peak <= held + 2 * result["largest_layer"], (name, spec, peak, held)
            for algo, run in result["algos"].items():
                kv = run["kv_cache_bytes"]
                assert min(kv[:roles.attention]) > 0 and kv[roles.attention:] == [0] * roles.ffn
                afd = run["afd"]
                assert (afd["attention"], afd["ffn"], afd["micro_batches"]) == \
                    (roles.attention, roles.ffn, micro)
                # every row crosses out and back, D = 64 float32s each way, to each FFN rank
                # for a dense layer; per token, through the 3 layers
                per_layer = afd["bytes_per_token_layer"]
                assert per_layer >= 2 * 64 * 4 * (roles.ffn if name == "llama" else 1)
                assert afd["bytes_per_token"] == pytest.approx(3 * per_layer, rel=1e-3)
                assert afd["straggler"]["ffn"]["slowest_rank"] >= roles.attention


def test_a_quantized_mixture_keeps_its_quantized_experts_apart(afd_models, tmp_path):
    """The 8-expert mixture in MLX's 4-bit form, ``--keep-quantized``: at 2:2 each FFN rank
    holds half the quantized experts (their scales and biases cut with them), the sides'
    bytes add up to one rank's, and the scores are one rank's."""
    from mlx_lm.convert import convert

    quantized = tmp_path / "qwen3_moe-4bit"
    convert(afd_models["qwen3_moe"][0], str(quantized), quantize=True, q_group_size=32,
            q_bits=4)
    (tmp_path / "doc.txt").write_text("The quick brown fox jumps over the lazy dog. " * 10)
    runs = {}
    for n, extra in ((1, []), (4, ["--afd", "2:2"])):
        out = tmp_path / f"scores-{n}.jsonl"
        summary = run_cli(n, ["score", "--model", str(quantized), "--keep-quantized",
                              "--text-file", str(tmp_path / "doc.txt"), "--output", str(out),
                              "--kv-dtype", "float32", "--json", *extra]).last_json()
        runs[n] = (summary, [json.loads(line)["logprob"] for line in out.open()])
    np.testing.assert_allclose(runs[4][1], runs[1][1], **TOLERANCE)
    weights = runs[4][0]["model_bytes"]
    assert weights[0] == weights[1] and weights[2] == weights[3] > 0
    assert weights[0] + weights[2] + weights[3] == runs[1][0]["model_bytes"][0]


def test_a_mixture_of_fewer_experts_than_ffn_ranks_is_refused(afd_models):
    """Each FFN rank holds whole experts: 8 experts over 9 FFN ranks is refused in one line
    naming the layer and the counts, as the load begins."""
    from spmd_cp.engine.afd.afd_load import load_afd_share
    from spmd_cp.errors import UserError

    with pytest.raises(UserError, match="--afd 1:9: layer 0: 8 experts cannot be divided "
                                        "over 9 FFN ranks"):
        load_afd_share(afd_models["qwen3_moe"][0], AfdRoles(1, 9), 1)


def test_roles_and_their_refusals():
    """A:F must add up to the ranks, each side at least one rank; doctor's roles."""
    assert afd_obstacle("2:1", 3) is None
    assert "names 4 ranks, the job has 3" in afd_obstacle("2:2", 3)
    assert "each side needs at least one rank" in afd_obstacle("3:0", 3)
    assert "expected A:F" in afd_obstacle("two", 3)
    report = afd_report(["a", "a", "b"], "2:1")
    assert (report["attention_ranks"], report["ffn_ranks"], report["ffn_hosts"]) == \
        ([0, 1], [2], ["b"])
    assert "attention ranks [0, 1] on a; FFN ranks [2] on b" in grid_lines(
        {"tp": 1, "error": None, "afd": report})[0]
    times = [{"wait_s": 1.0, "work_s": 3.0}, {"wait_s": 3.0, "work_s": 1.0},
             {"wait_s": 2.0, "work_s": 2.0}]
    assert straggler_summary(times, AfdRoles(2, 1))["attention"] == {
        "slowest_rank": 0, "wait_share": 0.25, "wait_shares": [0.25, 0.75]}


def test_generate_score_and_caches_with_afd_answer_as_one_rank(tmp_path):
    """The CLI users run, on the embedded model: ``generate --afd 2:1`` gives one rank's
    greedy tokens, reports the roles, the bytes crossed and the stragglers, and traces
    both sides' waits; its prompt cache continues as one rank's does; ``score --afd 2:2``
    on the GPU path's arithmetic (``--device gpu``, run on this CPU: the model's dtypes,
    the warm-up on every rank) scores as one rank's; settings it does not combine with
    are refused in one line."""
    args = ["generate", "--max-tokens", "10", "--json", "--kv-dtype", "float32"]
    first = ["--prompt", "Name three colours of the rainbow.", "--save-cache"]
    then = ["--prompt", "And three fruits?", "--load-cache"]
    one = run_cli(1, args + first + [str(tmp_path / "one")]).last_json()
    trace = tmp_path / "trace.json"
    launch = run_cli(3, args + ["--afd", "2:1", "--trace", str(trace)] + first
                     + [str(tmp_path / "afd")])
    afd = launch.last_json()
    assert afd["token_ids"] == one["token_ids"]
    assert (afd["cp"], afd["afd"]["attention"], afd["afd"]["ffn"]) == (2, 2, 1)
    assert afd["kv_cache_bytes"][2] == 0 and min(afd["kv_cache_bytes"][:2]) > 0
    assert min(afd["model_bytes"]) > 0
    # the quantized file held as float32 by the two sides: rank 0 names the alternative
    assert "--afd 2:1: the two sides hold the float32 weights between them" in launch.stderr
    assert afd["afd"]["bytes_per_token"] > 0 and set(afd["afd"]["straggler"]) == \
        {"attention", "ffn"}
    events = json.loads(trace.read_text())["traceEvents"]
    waits = {(e["pid"], e["name"]) for e in events if e.get("cat") == "wait"}
    assert (0, "wait: AFD rows back") in waits and (2, "wait: AFD rows in") in waits
    meta = json.loads((tmp_path / "afd" / "meta.json").read_text())
    assert (meta["afd"], meta["cp_size"], len(meta["shard_sha256"])) == ("2:1", 2, 2)
    again = run_cli(3, args + ["--afd", "2:1"] + then + [str(tmp_path / "afd")]).last_json()
    alone = run_cli(1, args + then + [str(tmp_path / "one")]).last_json()
    assert again["token_ids"] == alone["token_ids"]
    assert again["prompt_tokens_reused"] == alone["prompt_tokens_reused"] > 0
    (tmp_path / "doc.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    scored = {}
    for n, extra in ((1, []), (4, ["--afd", "2:2"])):
        out = tmp_path / f"scores-{n}.jsonl"
        run_cli(n, ["score", "--text-file", str(tmp_path / "doc.txt"), "--output", str(out),
                    "--device", "gpu", *extra])
        scored[n] = [json.loads(line)["logprob"] for line in out.open()]
    np.testing.assert_allclose(scored[4], scored[1], **TOLERANCE)
    for n, extra, message in [
            (4, ["--afd", "3:1"] + then + [str(tmp_path / "afd")],
             "was made --afd 2:1; this job runs --afd 3:1"),
            (3, ["--afd", "2:2"], "--afd 2:2 names 4 ranks, the job has 3"),
            (4, ["--afd", "2:2", "--tp", "2"], "--afd 2:2 does not combine with --tp"),
            (3, ["--afd", "2:1", "--decode-step", "native"],
             "--afd 2:1 does not combine with --decode-step native")]:
        assert_refused(n, args + (extra if "--prompt" in extra else
                                  extra + ["--prompt", "Hi"]), message)


def test_batch_and_serve_with_afd_answer_as_one_rank(tmp_path):
    """``batch --afd 2:1``: jobs after one document answer as one rank's, one after
    another (the second from the first's prefix), decoded three at a time (each
    attention rank's rows of a batched step cross to the FFN rank), and so with two
    micro-batches (each step two halves, one's attention while the FFN rank computes
    the other's MLP). ``serve --afd 2:1`` through the openai client: one rank's answer,
    again from its resident cache."""
    from test_serve import free_port, launch_server

    (tmp_path / "doc.txt").write_text("The GNU General Public License is a free, copyleft "
                                      "license for software and other kinds of works. " * 8)
    jobs = tmp_path / "jobs.jsonl"
    questions = (("a", "What is this?", 8), ("b", "Who wrote it?", 8), ("c", "Free?", 5))
    jobs.write_text("".join(json.dumps({"id": i, "prefix_file": "doc.txt", "prompt": q,
                                        "max_tokens": n, "ignore_eos": True}) + "\n"
                            for i, q, n in questions))
    answers, summaries = {}, {}
    together = ["--afd", "2:1", "--max-batch", "3"]
    for key, n, extra in (("one", 1, []), ("afd", 3, ["--afd", "2:1"]),
                          ("together", 3, together),
                          ("ping-pong", 3, together + ["--afd-micro-batches", "2"])):
        out = tmp_path / f"out-{key}.jsonl"
        summaries[key] = run_cli(n, ["batch", "--jobs", str(jobs), "--output", str(out),
                                     "--kv-dtype", "float32", "--json", *extra]).last_json()
        answers[key] = [json.loads(line) for line in out.open()]
    texts = {key: [a["text"] for a in each] for key, each in answers.items()}
    for key in ("afd", "together", "ping-pong"):
        assert texts[key] == texts["one"], key
    assert answers["afd"][1]["prefix_reused"]
    for key in ("together", "ping-pong"):
        assert summaries[key]["batch_sizes"].get("3", 0) > 0, summaries[key]
    assert summaries["ping-pong"]["afd"]["micro_batches"] == 2

    question = "What is the capital of France?"
    alone = run_cli(1, ["generate", "--prompt", question, "--max-tokens", "12", "--json",
                        "--kv-dtype", "float32"]).last_json()
    server = launch_server(free_port(), tmp_path / "server.log",
                           ["--afd", "2:1", "--kv-dtype", "float32"], ranks=3)
    try:
        server.wait_healthy()
        for _ in range(2):
            reply = server.client().chat.completions.create(
                model="any", messages=[{"role": "user", "content": question}],
                max_tokens=12, temperature=0)
            assert reply.choices[0].message.content == alone["text"], server.log()
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)
