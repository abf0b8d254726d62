"""The console script end to end under mpiexec: output contract, N-rank = 1-rank, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli

QUESTION = "What is the capital of France?\n"
JSON_FIELDS = ("text", "tokens", "prompt_tokens", "ranks", "algo", "ttft_s", "prefill_tok_s",
               "decode_tok_s")
PER_RANK_FIELDS = ("peak_mem_bytes", "kv_cache_bytes", "comm_bytes")


@pytest.fixture(scope="module")
def question_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "q.txt"
    path.write_text(QUESTION)
    return path


@pytest.fixture(scope="module")
def one_rank_answer(question_file):
    return run_cli(1, ["generate", "--prompt-file", str(question_file), "--max-tokens", "12",
                       "--json"]).last_json()


def test_generate_single_rank_answers_paris(one_rank_answer):
    summary = one_rank_answer
    assert "Paris" in summary["text"]
    for field in JSON_FIELDS:
        assert field in summary
    for field in PER_RANK_FIELDS:
        assert len(summary[field]) == 1
    assert summary["ranks"] == 1 and summary["prompt_tokens"] > 10
    assert summary["comm_bytes"] == [0]


def test_generate_two_ranks_same_tokens_and_streams_text(one_rank_answer):
    """Two ranks, the prompt read from stdin (``--prompt -``; one rank read the same
    question from --prompt-file): the one-rank answer, streamed once by rank 0."""
    launch = run_cli(2, ["generate", "--prompt", "-", "--max-tokens", "12", "--json"],
                     stdin=QUESTION)
    summary = launch.last_json()
    assert summary["text"] == one_rank_answer["text"]
    assert summary["tokens"] == one_rank_answer["tokens"]
    assert summary["ranks"] == 2
    assert all(len(summary[f]) == 2 for f in PER_RANK_FIELDS)
    assert all(b > 0 for b in summary["comm_bytes"])
    # Only rank 0 writes stdout: the answer once, then the JSON line.
    assert launch.stdout.count("Paris") == 2  # streamed text + the JSON "text" field
    assert "[rank 0/2]" in launch.stderr


def test_score_three_ranks_equals_one(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6 + "Numbers: 12345.")
    runs = {}
    for n in (1, 3):
        out = tmp_path / f"tokens-{n}.jsonl"
        summary = run_cli(n, ["score", "--text-file", str(text), "--output", str(out),
                              "--json"]).last_json()
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(lines) == summary["tokens"] - 1 == summary["predicted"]
        assert [line["pos"] for line in lines] == list(range(1, summary["tokens"]))
        runs[n] = (summary, lines)
    one, three = runs[1][1], runs[3][1]
    assert [line["token"] for line in one] == [line["token"] for line in three]
    np.testing.assert_allclose([line["logprob"] for line in three],
                               [line["logprob"] for line in one], rtol=1e-4, atol=1e-4)
    # argmax may only differ where two logits tie within float error; here none do.
    assert [line["argmax"] for line in one] == [line["argmax"] for line in three]
    ppl1, ppl3 = runs[1][0]["ppl"], runs[3][0]["ppl"]
    assert ppl1 == pytest.approx(ppl3, rel=1e-4)
    assert 1.0 < ppl1 < 1000.0
    assert np.exp(-np.mean([line["logprob"] for line in one])) == pytest.approx(ppl1, rel=1e-6)


# -- bad input: one clear line, non-zero exit, every rank, within seconds ----------------
def assert_refused(launch, *fragments):
    assert launch.returncode != 0
    errors = [line for line in launch.stderr.splitlines() if line.startswith("spmd-cp: error:")]
    assert len(errors) == 1, launch.stderr  # printed once, by rank 0
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in launch.stderr
    assert launch.elapsed < 30


def test_missing_prompt_file_is_named(tmp_path):
    missing = tmp_path / "nope.txt"
    launch = run_cli(2, ["generate", "--prompt-file", str(missing)], check=False, timeout=60)
    assert_refused(launch, "prompt file not found", str(missing))


def test_missing_model_is_named(tmp_path, question_file):
    missing = tmp_path / "no-model"
    launch = run_cli(2, ["generate", "--model", str(missing), "--prompt-file", str(question_file)],
                     check=False, timeout=60)
    assert_refused(launch, "model not found", str(missing))


def test_unknown_architecture_is_named(tmp_path, question_file):
    model = tmp_path / "gpt2-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    launch = run_cli(2, ["generate", "--model", str(model), "--prompt-file", str(question_file)],
                     check=False, timeout=60)
    assert_refused(launch, "unsupported model architecture", "'gpt2'")


def test_empty_prompt(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    launch = run_cli(2, ["generate", "--prompt-file", str(empty)], check=False, timeout=60)
    assert_refused(launch, "empty", str(empty))


def test_prompt_longer_than_max_context(question_file):
    launch = run_cli(2, ["generate", "--prompt-file", str(question_file), "--max-context", "8"],
                     check=False, timeout=60)
    assert_refused(launch, "prompt has 37 tokens", "--max-context 8")


def test_negative_max_tokens(question_file):
    launch = run_cli(2, ["generate", "--prompt-file", str(question_file), "--max-tokens", "-1"],
                     check=False, timeout=60)
    assert_refused(launch, "--max-tokens must be >= 0")


def test_unwritable_score_output(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("hello world")
    launch = run_cli(2, ["score", "--text-file", str(text), "--output",
                         str(tmp_path / "missing-dir" / "out.jsonl")], check=False, timeout=60)
    assert_refused(launch, "output directory does not exist")
