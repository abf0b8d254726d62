"""Bad flags and dangerous outputs are refused before any work; what the CLI streams and
prints: real mpiexec runs of the console script with the embedded SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import MPIEXEC, RANK_ENV, SPMD_CP, run_cli
from test_outputs import unwritable_directory

QUESTION = "What is the capital of France?\n"


def refused_before_loading(launch, *fragments):
    """One ``spmd-cp: error:`` line naming ``fragments``, exit 2, and no model loaded."""
    assert launch.returncode == 2, launch.stderr[-3000:]
    errors = [line for line in launch.stderr.splitlines() if line.startswith("spmd-cp: error:")]
    assert len(errors) == 1, launch.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "loaded in" not in launch.stderr and "Traceback" not in launch.stderr


def tokenizer():
    """The embedded model's tokenizer, built straight from the GGUF metadata."""
    import mlx.core as mx

    from spmd_cp.models.gguf import build_tokenizer, default_model_path

    _, meta = mx.load(default_model_path(), return_metadata=True)
    return build_tokenizer(meta)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    (root / "q.txt").write_text(QUESTION)
    (root / "doc.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    return root


# -- outputs that would destroy inputs or other files (points 1 and 5) -------------------
def test_score_output_that_is_the_document_is_refused(files):
    doc = files / "doc.txt"
    before = doc.read_text()
    launch = run_cli(2, ["score", "--text-file", str(doc), "--output", str(doc)], check=False,
                     timeout=60)
    refused_before_loading(launch, f"--output is the text file: {doc}")
    assert doc.read_text() == before


def test_save_cache_that_is_the_prompt_file_is_refused(files):
    prompt = files / "q.txt"
    launch = run_cli(2, ["generate", "--prompt-file", str(prompt), "--save-cache", str(prompt)],
                     check=False, timeout=60)
    refused_before_loading(launch, f"--save-cache is the prompt file: {prompt}")
    assert prompt.read_text() == QUESTION


def test_batch_output_that_is_a_jobs_document_is_refused(files, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "a", "prefix_file": str(files / "doc.txt"),
                                "prompt": "Which animal jumps?"}) + "\n")
    launch = run_cli(2, ["batch", "--jobs", str(jobs), "--output", str(files / "doc.txt")],
                     check=False, timeout=60)
    refused_before_loading(launch, "--output is a job's file:")


def test_existing_score_output_needs_overwrite_and_is_replaced_whole(files, tmp_path):
    out = tmp_path / "scores.jsonl"
    out.write_text("precious\n")
    args = ["score", "--text-file", str(files / "doc.txt"), "--output", str(out)]
    refused_before_loading(run_cli(2, args, check=False, timeout=60),
                           f"output {out} exists; use --overwrite")
    assert out.read_text() == "precious\n"
    inode = out.stat().st_ino
    summary = run_cli(1, args + ["--overwrite", "--json"]).last_json()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == summary["predicted"] == summary["tokens"] - 1
    assert out.stat().st_ino != inode  # a new file renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.jsonl"]


def test_unwritable_output_is_refused_before_the_model_loads(files, tmp_path):
    place = f"{unwritable_directory(tmp_path)}/scores.jsonl"
    launch = run_cli(2, ["score", "--text-file", str(files / "doc.txt"), "--output", place],
                     check=False, timeout=60)
    refused_before_loading(launch, f"output is not writable: {place}")


def test_existing_trace_file_needs_overwrite(files, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text("{}")
    launch = run_cli(2, ["score", "--text-file", str(files / "doc.txt"), "--output",
                         str(tmp_path / "s.jsonl"), "--trace", str(trace)], check=False,
                     timeout=60)
    refused_before_loading(launch, f"output {trace} exists; use --overwrite")


# -- one declaration of the sampling flags (point 4) ---------------------------------------
@pytest.mark.parametrize("command,flag,value,allowed", [
    ("generate", "--temp", "-1", ">= 0"),
    ("generate", "--top-p", "2", "in [0, 1]"),
    ("generate", "--min-p", "1.5", "in [0, 1]"),
    ("generate", "--top-k", "-3", ">= 0"),
    ("batch", "--min-p", "-0.5", "in [0, 1]"),
])
def test_sampling_flags_out_of_range_are_refused(files, tmp_path, command, flag, value, allowed):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "hi"}\n')
    inputs = (["--prompt-file", str(files / "q.txt")] if command == "generate" else
              ["--jobs", str(jobs), "--output", str(tmp_path / "out.jsonl")])
    launch = run_cli(2, [command, *inputs, flag, value], check=False, timeout=60)
    refused_before_loading(launch, f"{flag} must be {allowed}, got {float(value)}"
                           if flag != "--top-k" else f"{flag} must be {allowed}, got {value}")


# -- the streamed answer, --quiet, token ids, and prompt caches (points 7, 8, 10) ----------
def test_logs_never_cut_into_the_streamed_answer(files):
    """Two ranks, stdout and stderr in one pipe (a terminal, or 2>&1): the tensor-parallel
    probe's ``decode: ...`` line is logged after the answer's first tokens, and must wait
    until the answer's line has ended."""
    proc = subprocess.run([MPIEXEC, "-n", "2", *SPMD_CP, "generate", "--prompt-file",
                           str(files / "q.txt"), "--max-tokens", "12", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **RANK_ENV}, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert "Paris" in summary["text"] and summary["tokens"] >= 7
    assert "[rank 0/2] decode: " in proc.stdout  # the line that used to cut in
    assert summary["text"] + "\n" in proc.stdout
    # token_ids: the generated ids, which decode to the text (point 8).
    assert len(summary["token_ids"]) == summary["tokens"]
    assert tokenizer().decode(summary["token_ids"]) == summary["text"]


@pytest.fixture(scope="module")
def quiet_run_with_cache(files):
    """A quiet one-rank answer whose prompt cache goes into the prompt's own folder."""
    cache = files / "cache"
    cache.mkdir()
    (cache / "q.txt").write_text(QUESTION)
    launch = run_cli(1, ["generate", "--prompt-file", str(cache / "q.txt"), "--max-tokens", "3",
                         "--save-cache", str(cache), "--quiet"])
    return launch, cache


def test_quiet_prints_the_answer_and_no_logs(quiet_run_with_cache):
    launch, cache = quiet_run_with_cache
    assert launch.stdout.strip() and "[rank 0/1]" not in launch.stderr, launch.stderr
    assert (cache / "meta.json").is_file() and (cache / "q.txt").read_text() == QUESTION
    # Errors still print under --quiet.
    again = run_cli(1, ["generate", "--prompt-file", str(cache / "q.txt"), "--save-cache",
                        str(cache), "--quiet"], check=False, timeout=60)
    refused_before_loading(again, "already holds", "use --overwrite")


def test_cache_of_another_model_is_refused_before_loading(quiet_run_with_cache, tiny_models):
    _, cache = quiet_run_with_cache
    launch = run_cli(1, ["generate", "--load-cache", str(cache), "--prompt", "Again",
                         "--model", tiny_models["llama"]], check=False, timeout=60)
    refused_before_loading(launch, f"prompt cache {cache} was made with another model")
