"""Concurrent clients of `spmd-cp serve --max-batch B` against one request at a time.

    python benchmarks/bench_serve_batched.py [--ranks 2] [--batches 1 4 8] [--clients 8] \\
        [--tokens 48] [--rounds 2]

Every server is

    OPENBLAS_NUM_THREADS=1 mpiexec -n N spmd-cp serve --port PORT --max-batch B

on the embedded SmolLM2 (its default flags otherwise). Once it answers, one request warms
it up, then ``--clients`` clients (the official ``openai`` package, one thread each) send
a different chat question at the same moment, streamed, each ``--tokens`` greedy tokens
with ``ignore_eos``, so every server decodes the same number of tokens. Reported per B
(medians over ``--rounds`` interleaved rounds, a fresh server each): the wall time from
the first request sent to the last answer's end, the aggregate completion tok/s over it,
the median time to first token and to a whole answer, and how many answers equal B = 1's.
Results: benchmarks/results/serve_batched.json and .md.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import benchlib as bl  # noqa: E402
from serve_followups import client_when_up, free_port  # noqa: E402

QUESTIONS = ["What is a river?", "Why is the sky blue?", "How do bees make honey?",
             "What is a prime number?", "Describe a volcano.", "What do cats eat?",
             "How does a bridge stand?", "What is a comet?", "Why do leaves fall?",
             "What is a violin?", "How do glaciers move?", "What is rain?",
             "How do birds fly?", "What is a desert?", "Why is the sea salty?",
             "What is a star?"]


def ask(client, question: str, tokens: int, sent: float) -> dict:
    first, text = None, []
    for chunk in client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": question}], max_tokens=tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    return {"ttft_s": (first or time.perf_counter()) - sent,
            "seconds": time.perf_counter() - sent, "text": "".join(text)}


def one_server(ranks: int, batch: int, clients: int, tokens: int, log_path: Path) -> dict:
    port = free_port()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            bl.mpi_cmd(ranks, str(Path(sys.executable).parent / "spmd-cp"), "serve",
                       "--port", port, "--max-batch", batch),
            env=bl.bench_env(1), stdout=log, stderr=log, start_new_session=True)
    try:
        client = client_when_up(server, port)
        ask(client, "Hello.", 4, time.perf_counter())  # warm-up
        results = [None] * clients
        start = time.perf_counter()

        def one(index):
            results[index] = ask(client, QUESTIONS[index % len(QUESTIONS)], tokens, start)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    return {"max_batch": batch, "wall_s": wall, "tok_s": clients * tokens / wall,
            "ttft_s": bl.median([r["ttft_s"] for r in results]),
            "answer_s": bl.median([r["seconds"] for r in results]),
            "texts": [r["text"] for r in results]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs = []
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_serve_batched.log"
    for round_ in range(args.rounds):
        for batch in args.batches:
            bl.log(f"round {round_ + 1}: --max-batch {batch}")
            runs.append({"round": round_ + 1, **one_server(args.ranks, batch, args.clients,
                                                           args.tokens, log_path)})
    report(args, runs)


def report(args, runs: list[dict]):
    baseline = [r for r in runs if r["max_batch"] == args.batches[0]]
    base_tok_s = bl.median([r["tok_s"] for r in baseline])
    rows = []
    for batch in args.batches:
        mine = [r for r in runs if r["max_batch"] == batch]
        tok_s = bl.median([r["tok_s"] for r in mine])
        equal = sum(a == b for r in mine for a, b in zip(r["texts"], baseline[0]["texts"]))
        rows.append([args.ranks, batch, bl.fmt(bl.median([r["wall_s"] for r in mine])),
                     bl.fmt(tok_s, 1), f"{tok_s / base_tok_s:.2f}x",
                     bl.fmt(bl.median([r["ttft_s"] for r in mine])),
                     bl.fmt(bl.median([r["answer_s"] for r in mine])),
                     f"{equal} of {len(mine) * args.clients}"])
    command = bl.command_line("bench_serve_batched.py", sys.argv[1:])
    markdown = "\n".join([
        bl.header("Concurrent clients: serve --max-batch B", command),
        f"{args.clients} clients at once, one chat question each, {args.tokens} greedy "
        f"tokens each (ignore_eos, streamed); medians of {args.rounds} interleaved rounds, "
        "a fresh server each\n",
        bl.table(["N", "max batch", "wall s", "completion tok/s", f"vs B={args.batches[0]}",
                  "time to first token s", "answer s", f"texts equal to B={args.batches[0]}'s"],
                 rows)])
    print(markdown)
    bl.save("serve_batched", {"command": command, "machine": bl.machine(), "runs": runs},
            markdown)


if __name__ == "__main__":
    main()
