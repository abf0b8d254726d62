"""spmd-cp batch: validation up front, per-job errors, input order, shared-document reuse,
resume after SIGKILL, and answers equal to one-by-one ``spmd-cp generate`` runs.

The end-to-end runs use the embedded SmolLM2 on 2 real MPI ranks, greedy, few tokens.
The pure parts (jobs file, results file, progress) are tested in process first.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import MPIEXEC, RANK_ENV, SPMD_CP, run_cli
from spmd_cp.errors import UserError
from spmd_cp.cli.jobs import ResultWriter, group_jobs, load_finished, read_jobs
from spmd_cp.cli.progress import Progress

DOCUMENT = (
    "The town of Larkspur sits on the northern bank of the Velda river. It was founded in "
    "1820 by a group of clockmakers who moved there from the coast. Today about 4,000 people "
    "live in Larkspur. The town is famous for its clock tower, which was built in 1852 and is "
    "48 meters tall. Every year in May the town holds a festival of lanterns. The mayor of "
    "Larkspur is Helena Brandt, who was elected in 2019. The main industry is still the making "
    "of watches and small instruments, and the largest employer is the Velda Instrument "
    "Company, which has 600 workers. The town has one school, two bakeries and a small "
    "railway station with trains to the capital every hour.\n")
QUESTIONS = {"d1": "Who is the mayor of Larkspur?", "d2": "How tall is the clock tower?",
             "d3": "When was Larkspur founded?"}
SYSTEM = "You are a concise assistant."
MAX_TOKENS = 8
# The shared-document jobs are spread out so that execution order (d1, d2, d3 together)
# differs from input order; the kill comes after "a" and "missing", before d1 ends.
JOBS = [
    {"id": "a", "prompt_file": "q/capital.txt"},
    {"id": "missing", "prompt_file": "q/nope.txt"},
    {"id": "d1", "prefix_file": "doc.txt", "prompt": QUESTIONS["d1"]},
    {"id": "b", "prompt": "Name a primary color.", "system": SYSTEM},
    {"id": "d2", "prefix_file": "doc.txt", "prompt": QUESTIONS["d2"]},
    {"id": "d3", "prefix_file": "doc.txt", "prompt": QUESTIONS["d3"]},
    {"id": "long", "prompt": "hello " * 1200},  # over --max-context
    {"id": "blank", "prompt": "  \n"},
]
MAX_CONTEXT = 1000
ERRORS = {"missing": "file_not_found", "long": "prompt_too_long", "blank": "empty_prompt"}
IDS = [job["id"] for job in JOBS]
TORN = b'{"id": "d1", "text": "The may'


def write_jobs(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# -- pure parts ------------------------------------------------------------------------
def test_read_jobs_resolves_paths_and_groups_documents(tmp_path):
    jobs = read_jobs(write_jobs(tmp_path / "jobs.jsonl", JOBS + ["", {"id": "e", "prompt": "x",
                                                                      "stop": "\n"}]))
    assert [j.id for j in jobs] == IDS + ["e"]
    assert jobs[0].prompt_file == (tmp_path / "q" / "capital.txt").resolve()
    assert jobs[-1].line == len(JOBS) + 2 and jobs[-1].stop == ("\n",)
    order = [[j.id for j in group] for group in group_jobs(jobs)]
    assert order == [["a"], ["missing"], ["d1", "d2", "d3"], ["b"], ["long"], ["blank"], ["e"]]


def test_read_jobs_names_every_bad_line(tmp_path):
    path = write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "ok", "prompt": "hi"},
        '{"id": "broken", "prompt": ',                         # 2: invalid JSON
        {"prompt": "no id"},                                    # 3: missing id
        {"id": "ok", "prompt": "again"},                        # 4: duplicate id
        {"id": "t", "prompt": "x", "max_tokens": "12"},         # 5: wrong type
        {"id": "u", "prompt": "x", "temprature": 0.5},          # 6: unknown key
        {"id": "v"},                                            # 7: no prompt
        ["not", "an", "object"],                                # 8
    ])
    with pytest.raises(UserError) as error:
        read_jobs(path)
    message = str(error.value)
    assert "bad lines 2, 3, 4, 5, 6, 7, 8:" in message
    for fragment in ("invalid JSON", "missing 'id'", "duplicate id 'ok' (first on line 1)",
                     "'max_tokens' must be an integer", "unknown key 'temprature'",
                     "exactly one of 'prompt' or 'prompt_file'", "not a JSON object"):
        assert fragment in message
    assert "\n" not in message


def test_load_finished_drops_torn_tail_and_refuses_corrupt_middle(tmp_path):
    out = tmp_path / "out.jsonl"
    good = b'{"id": "a", "text": "x"}\n{"id": "b", "error": {"type": "t", "message": "m"}}\n'
    out.write_bytes(good + b'{"id": "c", "te')                  # no newline: torn
    with pytest.raises(UserError, match="exists; use --resume or remove it"):
        load_finished(out, resume=False)
    finished = load_finished(out, resume=True)
    assert finished.ids == ["a", "b"] and finished.dropped_bytes == 15
    assert out.read_bytes() == good
    out.write_bytes(good + b'{"id": "c", "te\n')                # ended but invalid: torn
    assert load_finished(out, resume=True).ids == ["a", "b"] and out.read_bytes() == good
    out.write_bytes(b'{"id": "a", "text": "x"}\n{oops\n{"id": "b", "text": "y"}\n')
    with pytest.raises(UserError, match="line 2 is not a result line"):
        load_finished(out, resume=True)
    out.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(UserError, match="lines 1 and 2 both answer id 'a'"):
        load_finished(out, resume=True)


def test_result_writer_holds_results_until_earlier_ones_are_written(tmp_path):
    out = tmp_path / "out.jsonl"
    writer = ResultWriter(out, ["a", "b", "c"])
    assert writer.add({"id": "c", "text": "3"}) == 0 and out.read_text() == ""
    assert writer.add({"id": "a", "text": "1"}) == 1
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a"]
    assert writer.add({"id": "b", "text": "2"}) == 2
    writer.close()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b", "c"]


def test_progress_lines_are_throttled_and_footer_is_mlx_lm_style():
    now = [0.0]
    stream = io.StringIO()
    progress = Progress(3, mode="lines", stream=stream, interval=5.0, prefill_chunk=100,
                        clock=lambda: now[0])
    update = progress.prefill_callback("q1")
    update(100, 250)                                 # first event: drawn
    now[0] = 1.0
    update(200, 250)                                 # within 5 s: not drawn
    now[0] = 6.0
    update(250, 250)
    now[0] = 8.0
    progress.job_done(prefilled=250, generated=11, prefill_s=2.0, decode_s=5.0)
    now[0] = 9.0
    progress.job_done(failed=True)
    now[0] = 10.0
    progress.job_done(prefilled=50, generated=1, prefill_s=0.5)  # the last: always drawn
    lines = stream.getvalue().splitlines()
    assert lines[0] == "batch 0/3 jobs | q1: prefill 100/250 tok (chunk 1/3) | 0.0 tok/s | ETA ?"
    assert lines[1].startswith("batch 0/3 jobs | q1: prefill 250/250 tok (chunk 3/3)")
    assert lines[2] == "batch 3/3 jobs (1 failed) | 31.2 tok/s | took 10s"
    assert len(lines) == 3
    assert progress.footer([2**30, 2**29]).splitlines()[1:] == [
        "Prompt: 300 tokens, 120.000 tokens-per-sec",
        "Generation: 12 tokens, 2.000 tokens-per-sec",
        "Peak memory: 1.074 GB (rank 0), 0.537 GB (rank 1)"]


def test_progress_bar_redraws_one_line():
    stream = io.StringIO()
    progress = Progress(1, mode="bar", stream=stream, clock=lambda: 0.0)
    progress.prefill_callback("x")(5, 10)
    progress.clear()
    progress.job_done(prefilled=10, generated=2)
    progress.close()
    assert stream.getvalue().count("\n") == 1 and stream.getvalue().count("\r") == 3


# -- end to end -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    (root / "q").mkdir()
    (root / "q" / "capital.txt").write_text("What is the capital of France?\n")
    (root / "doc.txt").write_text(DOCUMENT)
    write_jobs(root / "jobs.jsonl", [{**job, "max_tokens": MAX_TOKENS} for job in JOBS])
    return root


def assert_refused_fast(launch, *fragments):
    assert launch.returncode != 0
    errors = [line for line in launch.stderr.splitlines() if line.startswith("spmd-cp: error:")]
    assert len(errors) == 1, launch.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in launch.stderr and "loaded in" not in launch.stderr
    assert launch.elapsed < 20


def test_malformed_jobs_file_is_refused_before_the_model_loads(tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "fine", "prompt": "hi"}, "{not json", {"id": "fine", "prompt": "dup"},
        {"id": "x", "prompt": "hi", "max_tokens": -3}])
    out = tmp_path / "out.jsonl"
    launch = run_cli(2, ["batch", "--jobs", str(jobs), "--output", str(out)], check=False,
                     timeout=60)
    assert_refused_fast(launch, "bad lines 2, 3, 4:", "invalid JSON", "duplicate id 'fine'",
                        "'max_tokens' must be an integer >= 0")
    assert not out.exists()


def test_existing_output_is_refused_without_resume(workdir, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "old"}\n')
    launch = run_cli(2, ["batch", "--jobs", str(workdir / "jobs.jsonl"), "--output", str(out)],
                     check=False, timeout=60)
    assert_refused_fast(launch, f"output {out} exists; use --resume or remove it")
    assert out.read_text() == '{"id": "a", "text": "old"}\n'


@pytest.fixture(scope="module")
def killed_then_resumed(workdir):
    """Run the batch, SIGKILL the whole job once 2 lines are written, tear a line, resume."""
    out = workdir / "out.jsonl"
    argv = [MPIEXEC, "-n", "2", *SPMD_CP, "batch", "--jobs", str(workdir / "jobs.jsonl"),
            "--output", str(out), "--max-context", str(MAX_CONTEXT), "--progress", "lines"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **RANK_ENV}, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no 2 result lines within 120 s"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stderr.close()
    before_kill = out.read_bytes()
    with open(out, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(TORN)
    resumed = run_cli(2, ["batch", "--jobs", str(workdir / "jobs.jsonl"), "--output", str(out),
                          "--max-context", str(MAX_CONTEXT), "--resume", "--json"],
                      timeout=150)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return before_kill, resumed, records, {r["id"]: r for r in records}


def test_resume_after_sigkill_answers_every_id_once_and_keeps_written_lines(killed_then_resumed,
                                                                             workdir):
    before_kill, resumed, records, _ = killed_then_resumed
    written = before_kill.count(b"\n")
    assert 2 <= written < len(JOBS), "the kill came too late to test anything"
    assert before_kill.endswith(b"\n")
    assert (workdir / "out.jsonl").read_bytes().startswith(before_kill)  # byte-identical
    assert [r["id"] for r in records] == IDS  # every id once, in input order
    assert f"dropped a torn last line ({len(TORN)} bytes)" in resumed.stderr
    assert f"{written} already in" in resumed.stderr
    summary = resumed.last_json()
    assert summary["jobs"] == len(JOBS) - written and summary["errors"] == 2
    assert summary["ranks"] == 2 and len(summary["peak_mem_bytes"]) == 2
    # auto where the native step runs: 8, the document's three jobs decoded together
    assert summary["max_batch"] == 8 and summary["batched_step"] == "native"
    assert summary["batch_sizes"].get("3", 0) > 0
    assert all(b > 0 for b in summary["kv_cache_bytes"])
    assert summary["decode_setup_s"] > 0  # decode's collectives opened before the first job
    # Rank 0's progress lines and mlx-lm style footer.
    assert "batch 0/" in resumed.stderr and "Generation:" in resumed.stderr
    assert "Peak memory:" in resumed.stderr


def test_per_job_problems_are_error_lines_and_the_rest_answered(killed_then_resumed, workdir):
    by_id = killed_then_resumed[3]
    assert by_id["missing"]["error"] == {
        "type": "file_not_found",
        "message": f"prompt file not found: {(workdir / 'q' / 'nope.txt').resolve()}"}
    assert {i: by_id[i]["error"]["type"] for i in ERRORS} == ERRORS
    assert f"more than --max-context {MAX_CONTEXT}" in by_id["long"]["error"]["message"]
    assert all("text" not in by_id[i] for i in ERRORS)
    for job_id in set(IDS) - set(ERRORS):
        record = by_id[job_id]
        assert record["text"] and "error" not in record
        assert 0 < record["tokens"] <= MAX_TOKENS and record["finish_reason"] in ("stop", "length")
        assert len(record["token_ids"]) == record["tokens"]
        for field in ("prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s"):
            assert record[field] >= 0
    assert "Paris" in by_id["a"]["text"]


def test_shared_document_is_prefilled_once(killed_then_resumed):
    by_id = killed_then_resumed[3]
    group = [by_id[i] for i in ("d1", "d2", "d3")]
    assert [r["prefix_reused"] for r in group] == [False, True, True]
    assert group[0]["prompt_tokens_prefilled"] == group[0]["prompt_tokens"]
    assert all(r["prompt_tokens_reused"] == r["prompt_tokens"] - r["prompt_tokens_prefilled"]
               for r in group)
    shared = {r["prompt_tokens_reused"] for r in group[1:]}
    assert len(shared) == 1 and shared.pop() > 150  # the chat header and the document
    for r in group[1:]:
        assert r["prompt_tokens_prefilled"] * 8 < r["prompt_tokens"]
    assert not by_id["a"]["prefix_reused"] and not by_id["b"]["prefix_reused"]
    summary = killed_then_resumed[1].last_json()
    assert summary["prompt_tokens_reused"] == sum(
        r["prompt_tokens"] - r["prompt_tokens_prefilled"] for r in group)


@pytest.mark.parametrize("job_id", ["b", "d3"])
def test_greedy_answers_equal_generate_one_by_one(killed_then_resumed, workdir, job_id):
    """A prompt job (with a system message) and a job answered after a cached document,
    against ``generate`` on the same prompt (for a document job: the file
    "document\\n\\nquestion", docs/BATCH.md)."""
    job = next(j for j in JOBS if j["id"] == job_id)
    args = ["generate", "--max-tokens", str(MAX_TOKENS), "--json"]
    if "prefix_file" in job:
        prompt_file = workdir / f"{job_id}-joined.txt"
        prompt_file.write_text(DOCUMENT.strip() + "\n\n" + job["prompt"] + "\n")
        args += ["--prompt-file", str(prompt_file)]
    else:
        args += ["--prompt", job["prompt"], "--system", job["system"]]
    alone = run_cli(2, args).last_json()
    batched = killed_then_resumed[3][job_id]
    assert batched["prompt_tokens"] == alone["prompt_tokens"]
    assert batched["text"] == alone["text"]
    assert batched["tokens"] == alone["tokens"]
    assert batched["token_ids"] == alone["token_ids"]


def test_jobs_decoded_together_equal_their_answers_alone(killed_then_resumed, workdir):
    """``--max-batch 2`` on six jobs after one document (2 ranks): a job joins the batch
    as another leaves, and each greedy answer is the resumed run's (``--max-batch auto``:
    its three jobs together, d3's equal to ``generate``'s alone, the test above), both
    over the native steps' float16 cache; a question longer than PROMPT_ROWS tokens is
    prefilled on its own, not fed as rows, and answers as ``generate`` does;
    ``ignore_eos`` decodes exactly max_tokens tokens (a sampled job's rows among the
    greedy ones); the summary counts the batched steps."""
    from spmd_cp.engine.scheduler import PROMPT_ROWS

    long_question = "Answer in one word. " * 12 + QUESTIONS["d2"]
    extra = [{"id": "d4", "prefix_file": "doc.txt", "prompt": "Describe the town.",
              "max_tokens": 12, "ignore_eos": True, "temperature": 0.8},
             {"id": "d5", "prefix_file": "doc.txt", "prompt": QUESTIONS["d1"], "max_tokens": 1},
             {"id": "d6", "prefix_file": "doc.txt", "prompt": long_question,
              "max_tokens": MAX_TOKENS}]
    jobs = [{**job, "max_tokens": MAX_TOKENS} for job in JOBS if "prefix_file" in job]
    path = write_jobs(workdir / "together.jsonl", jobs + extra)
    out = workdir / "together-out.jsonl"
    summary = run_cli(2, ["batch", "--jobs", str(path), "--output", str(out), "--max-batch",
                          "2", "--json"], timeout=150)
    assert "--kv-dtype auto: float16 (decode steps run natively)" in summary.stderr
    summary = summary.last_json()
    assert summary["batched_step"] == "native"  # engine/decode/native_batched.py
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    alone = killed_then_resumed[3]
    for job_id in ("d1", "d2", "d3"):
        assert by_id[job_id]["token_ids"] == alone[job_id]["token_ids"], job_id
        assert by_id[job_id]["text"] == alone[job_id]["text"]
    assert by_id["d5"]["token_ids"] == alone["d1"]["token_ids"][:1]
    assert by_id["d4"]["tokens"] == 12 and by_id["d4"]["finish_reason"] == "length"
    assert [r["id"] for r in map(json.loads, out.read_text().splitlines())] == \
        ["d1", "d2", "d3", "d4", "d5", "d6"]
    assert summary["max_batch"] == 2 and summary["answered"] == 6
    assert summary["batch_sizes"].get("2", 0) > 0 and summary["decode_tok_s"] > 0
    assert summary["prompts_as_rows"] == 5  # all but d6
    assert by_id["d6"]["prompt_tokens_prefilled"] > PROMPT_ROWS
    prompt_file = workdir / "d6-joined.txt"
    prompt_file.write_text(DOCUMENT.strip() + "\n\n" + long_question + "\n")
    alone_d6 = run_cli(2, ["generate", "--max-tokens", str(MAX_TOKENS), "--json",
                           "--prompt-file", str(prompt_file)]).last_json()
    assert by_id["d6"]["token_ids"] == alone_d6["token_ids"]


def test_gpu_path_batches_by_default_and_equals_its_jobs_alone(workdir):
    """The GPU path's arithmetic (``--device gpu``, run on this CPU): ``--max-batch
    auto`` decodes up to 8 jobs together, and every answer equals the GPU path's answer
    one job at a time (2 ranks)."""
    jobs = [{**job, "max_tokens": MAX_TOKENS} for job in JOBS if "prefix_file" in job]
    path = write_jobs(workdir / "gpu-path.jsonl", jobs)
    answers = {}
    for setting in ("auto", "1"):
        out = workdir / f"gpu-path-{setting}.jsonl"
        summary = run_cli(2, ["batch", "--jobs", str(path), "--output", str(out), "--device",
                              "gpu", "--max-batch", setting, "--json"],
                          timeout=150).last_json()
        assert summary["max_batch"] == (8 if setting == "auto" else 1) and summary["errors"] == 0
        answers[setting] = {r["id"]: r["token_ids"]
                            for r in map(json.loads, out.read_text().splitlines())}
        if setting == "auto":
            assert summary["batch_sizes"].get("3", 0) > 0, summary["batch_sizes"]
    assert answers["auto"] == answers["1"]
