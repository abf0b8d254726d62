"""`spmd-cp serve --max-batch`: requests decoded together on one real 2-rank server,
driven by the official `openai` package and raw sockets. Every answer is checked against
one sequence decoded alone (`batch --max-batch 1` and `generate`, the one-request-at-a-time
path test_serve.py checks): greedy texts equal.

The requests use the completions endpoint (no chat template), so that the references
take the same prompt text through `--no-chat-template`. The last test stops the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading

import pytest

from conftest import MPIEXEC, run_cli
from spmd_cp.server.serving import PREFILL_SLICE
from test_serve import (HANG_S, REQUEST_TIMEOUT_S, free_port, launch_server, serving,
                        streaming_completion, wait_for)

openai = pytest.importorskip("openai", reason="the openai client: pip install openai")

MAX_BATCH = 3
MAX_CONTEXT = 512
MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are", "My favourite season is"]  # more than MAX_BATCH
FIRST_TURN = "Q: Name a red fruit.\nA:"
# Longer than serve's prefill slice: prefilled in slices between the running steps.
LONG = "Continue the list: " + ", ".join(str(i) for i in range(100, 180))


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """The server (--max-batch 3), and each prompt's answer decoded alone."""
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    folder = tmp_path_factory.mktemp("serve-batched")
    jobs = folder / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                            for i, p in enumerate([*PROMPTS, FIRST_TURN, LONG])))
    run_cli(2, ["batch", "--jobs", str(jobs), "--output", str(folder / "alone.jsonl"),
                "--max-batch", "1", "--no-chat-template", "--max-tokens", str(MAX_TOKENS),
                "--temp", "0", "--max-context", str(MAX_CONTEXT)], timeout=300)
    alone = [json.loads(line) for line in (folder / "alone.jsonl").read_text().splitlines()]
    running = launch_server(free_port(), folder / "server.log",
                            ["--max-batch", str(MAX_BATCH), "--max-context", str(MAX_CONTEXT),
                             "--json"])
    running.alone = {p: record["text"] for p, record in zip([*PROMPTS, FIRST_TURN, LONG], alone)}
    with serving(running):
        yield running


def complete(server, prompt: str, max_tokens: int = MAX_TOKENS, **extra):
    return server.client().completions.create(model="any", prompt=prompt,
                                              max_tokens=max_tokens, temperature=0, **extra)


def at_once(calls) -> list:
    """Run the calls in threads at once; their results (an exception: re-raised)."""
    results = [None] * len(calls)

    def run(index):
        try:
            results[index] = calls[index]()
        except Exception as error:  # noqa: BLE001 - the test's failure, raised below
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_S)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def streamed(server, prompt: str) -> str:
    return "".join(c.choices[0].text for c in complete(server, prompt, stream=True))


def test_concurrent_requests_decode_together_and_equal_each_alone(batched):
    """Five clients at once, one streaming: three decode together, the others join as
    slots free; every text is the one decoded alone."""
    calls = [lambda p=p: complete(batched, p).choices[0].text for p in PROMPTS[1:]]
    texts = at_once([lambda: streamed(batched, PROMPTS[0]), *calls])
    assert texts == [batched.alone[p] for p in PROMPTS]
    status, health = batched.get("/health")
    assert health["max_batch"] == MAX_BATCH and health["running"] == 0
    assert health["requests_served"] >= len(PROMPTS)
    # Requests ended while others were still decoding: they ran together.
    running = [int(n) for n in re.findall(r"generated, \w+; (\d+) running", batched.log())]
    assert max(running) >= 1, batched.log()
    # short prompts joined as rows of the running requests' steps (scheduler.PROMPT_ROWS)
    assert "the rest as rows of a step" in batched.log()


def test_n_choices_decode_together_whole_and_streamed(batched):
    """n = 3 greedy choices decode together (the batch's three slots): each the text
    decoded alone; streamed, each index's events make that text."""
    logged = len(batched.log())
    reply = complete(batched, PROMPTS[2], n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [batched.alone[PROMPTS[2]]] * 3
    texts = ["", ""]
    for event in complete(batched, PROMPTS[4], n=2, stream=True):
        for choice in event.choices:
            texts[choice.index] += choice.text
    assert texts == [batched.alone[PROMPTS[4]]] * 2
    # a choice ended while the others still decoded: they ran together
    running = [int(n) for n in re.findall(r"generated, \w+; (\d+) running",
                                          batched.log()[logged:])]
    assert max(running) >= 1, batched.log()


def test_follow_up_reuses_its_prompt_beside_another_request(batched):
    """A follow-up's prompt begins with the first turn's: its resident entry (the prompt
    fed as rows of a step and the answer decoded in a slot, both written back to it) is
    reused, while another request decodes."""
    first = complete(batched, FIRST_TURN)
    assert first.choices[0].text == batched.alone[FIRST_TURN]
    follow = FIRST_TURN + first.choices[0].text + "\nQ: And a yellow one?\nA:"
    expected = run_cli(2, ["generate", "--prompt", follow, "--no-chat-template",
                           "--max-tokens", str(MAX_TOKENS), "--temp", "0", "--json",
                           "--max-context", str(MAX_CONTEXT)], timeout=300).last_json()
    reply, other = at_once([lambda: complete(batched, follow),
                            lambda: complete(batched, PROMPTS[1]).choices[0].text])
    assert reply.choices[0].text == expected["text"]
    # the first answer's tokens too (all but where its text meets the next question's)
    assert reply.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert other == batched.alone[PROMPTS[1]]


def test_a_long_prompt_joins_in_slices_and_a_client_leaving_ends_only_its_own(batched):
    """A prompt longer than a prefill slice joins a running count (its prefill in
    slices between the count's steps) and gets the text decoded alone; then the count's
    client leaves, and only the count ends."""
    _, before = batched.get("/health")
    with streaming_completion(batched, {"max_tokens": 2000, "ignore_eos": True}) as (sock, head):
        assert head.startswith(b"HTTP/1.0 200"), head
        reply = complete(batched, LONG)
        counted = sock.recv(65536)
    assert reply.usage.prompt_tokens > PREFILL_SLICE
    assert reply.choices[0].text == batched.alone[LONG]
    assert b"data: " in counted  # the count still streams
    wait_for(lambda: batched.get("/health")[1]["requests_cancelled"]
             > before["requests_cancelled"] and batched.get("/health")[1]["running"] == 0,
             "the count was not cancelled")
    assert complete(batched, PROMPTS[3]).choices[0].text == batched.alone[PROMPTS[3]]


def test_sigterm_finishes_every_running_answer_then_stops(batched):
    """Last: it ends the module's server. SIGTERM with a full batch and one request
    waiting for a slot: the three answers are finished to their last token, the waiting
    one gets a 503, every rank exits 0."""
    usage = {"max_tokens": 200, "ignore_eos": True, "stream_options": {"include_usage": True}}
    streams = [streaming_completion(batched, usage) for _ in range(MAX_BATCH)]
    sockets = [stream.__enter__() for stream in streams]
    wait_for(lambda: batched.get("/health")[1]["running"] == MAX_BATCH, "a batch of three")
    queued = {}

    def ask_while_full():
        try:
            complete(batched, PROMPTS[0], max_tokens=4)
            queued["answer"] = "answered"
        except openai.APIStatusError as error:
            queued["answer"] = (error.status_code, error.body)

    waiter = threading.Thread(target=ask_while_full)
    waiter.start()
    wait_for(lambda: batched.get("/health")[1]["queue_length"] >= 1, "a queued request")
    os.killpg(batched.proc.pid, signal.SIGTERM)
    for stream, (sock, head) in zip(streams, sockets):
        received = head
        while chunk := sock.recv(65536):
            received += chunk
        stream.__exit__(None, None, None)
        events = [json.loads(line[len(b"data: "):]) for line in received.split(b"\n")
                  if line.startswith(b"data: {")]
        assert received.rstrip().endswith(b"data: [DONE]"), received[-300:]
        assert events[-1]["usage"]["completion_tokens"] == 200, events[-1]
    waiter.join(REQUEST_TIMEOUT_S)
    assert queued["answer"][0] == 503 and queued["answer"][1]["code"] == "shutting_down"
    try:
        code = batched.proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within {HANG_S} s of SIGTERM:\n{batched.log()}")
    assert code == 0, batched.log()
