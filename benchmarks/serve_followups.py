#!/usr/bin/env python3
"""Time to first token of follow-up questions about one long document: `spmd-cp serve`
(the document's KV stays resident) against a fresh `generate` job and `generate
--load-cache` for the same follow-up.

    python benchmarks/serve_followups.py --ranks 2 --doc-chars 24000 --followups 5

The document is the repository's docs/*.md, cut to --doc-chars characters. The server is
asked the first question, then each follow-up repeats the conversation so far (as chat
clients do). Time to first token is measured by the client, from sending the request to
the first streamed text; for the `generate` jobs, from starting mpiexec to the first
byte of the answer on stdout (the start-up and model load included: that is what a new
job costs). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
QUESTIONS = ["What is this document about?", "Which command serves a model?",
             "What does the watchdog do?", "How are prompt caches saved?",
             "Which attention algorithms are described?", "What is pass-Q?"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(ranks: int, port: int):
    """(the `spmd-cp serve` process group, an OpenAI client of it) once it answers."""
    server = subprocess.Popen([str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "spmd-cp"),
                               "serve", "--port", str(port), "-q"], env=ENV,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    return server, client_when_up(server, port)


def client_when_up(server: subprocess.Popen, port: int):
    """An OpenAI client of the `spmd-cp serve` started as ``server`` once it answers (the
    server's process group is killed where it does not within 300 s)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=600)
    deadline = time.monotonic() + 300
    while True:
        try:
            client.models.list()
            return client
        except openai.APIError:
            if time.monotonic() > deadline or server.poll() is not None:
                os.killpg(server.pid, signal.SIGKILL)
                raise
            time.sleep(0.5)


def first_byte_s(cmd: list[str]) -> tuple[float, str]:
    """Seconds from launch to the first stdout byte, and the whole stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV)
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    rest = proc.stdout.read()
    proc.wait(timeout=600)
    return elapsed, (first + rest).decode()


def stream_ttft(client, messages, max_tokens) -> tuple[float, str, int]:
    start = time.perf_counter()
    ttft, text, cached = None, "", 0
    for chunk in client.chat.completions.create(
            model="any", messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - start
            text += chunk.choices[0].delta.content
        if chunk.usage:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft, text, cached


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--doc-chars", type=int, default=24000)
    parser.add_argument("--followups", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    document = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    document = document[:args.doc_chars]
    spmd = [str(BIN / "mpiexec"), "-n", str(args.ranks), str(BIN / "spmd-cp")]
    server, client = start_server(args.ranks, free_port())
    result = {"ranks": args.ranks, "doc_chars": len(document), "followups": []}
    try:
        first = document + "\n\n" + QUESTIONS[0]
        messages = [{"role": "user", "content": first}]
        ttft, text, _ = stream_ttft(client, messages, args.max_tokens)
        result["first_ttft_s"] = round(ttft, 3)
        for question in QUESTIONS[1:1 + args.followups]:
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": question}]
            ttft, text, cached = stream_ttft(client, messages, args.max_tokens)
            result["followups"].append({"ttft_s": round(ttft, 3), "cached_tokens": cached})
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    with tempfile.TemporaryDirectory() as saved:
        common = ["--max-tokens", str(args.max_tokens), "-q"]
        fresh, _ = first_byte_s(spmd + ["generate", "--prompt", first, "--save-cache",
                                        saved + "/c", "--overwrite", *common])
        loaded, _ = first_byte_s(spmd + ["generate", "--load-cache", saved + "/c",
                                         "--prompt", QUESTIONS[1], *common])
    result["generate_fresh_first_token_s"] = round(fresh, 3)
    result["generate_load_cache_first_token_s"] = round(loaded, 3)
    follow = sorted(f["ttft_s"] for f in result["followups"])
    result["median_followup_ttft_s"] = follow[len(follow) // 2]
    import benchlib as bl

    result.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  machine=bl.machine(), command="python benchmarks/serve_followups.py "
                  + " ".join(sys.argv[1:]))
    (bl.RESULTS / "serve_followups.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
