#!/usr/bin/env python3
"""Resident memory of `spmd-cp serve`'s ranks over many requests: does it stay flat?

    python benchmarks/serve_soak.py --ranks 2 --requests 100 --conversations 6

Requests cycle through more conversations than --cache-entries (4 by default), each
turn repeating its conversation so far, so entries are continued, copied and evicted all
along. Every --every requests the ranks' resident set sizes (/proc/PID/status VmRSS) and
/health's cache figures are recorded. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_followups import free_port, start_server  # noqa: E402

TOPICS = ["cats", "rivers", "bridges", "volcanoes", "violins", "glaciers", "comets"]


def rank_pids(port: int) -> list[int]:
    """The ranks: the spmd-cp serve processes started with this --port that are not the
    launcher (mpiexec's proxy starts them in a session of their own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (cmdline and not cmdline[0].endswith(b"mpiexec") and b"serve" in cmdline
                and any(part.endswith(b"spmd-cp") for part in cmdline)
                and str(port).encode() in cmdline):
            pids.append(int(entry.name))
    return sorted(pids)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    port = free_port()
    server, client = start_server(args.ranks, port)
    samples = []
    try:
        conversations = [[] for _ in range(args.conversations)]
        start = time.perf_counter()
        for index in range(args.requests + 1):
            if index % args.every == 0:
                health = json.loads(subprocess.run(
                    ["curl", "-s", f"http://127.0.0.1:{port}/health"], capture_output=True,
                    text=True, timeout=30).stdout)
                samples.append({"requests": index,
                                "rss_mb": [round(rss_mb(p), 1) for p in rank_pids(port)],
                                "cache": health["cache"]})
            if index == args.requests:
                break
            messages = conversations[index % args.conversations]
            topic = TOPICS[index % len(TOPICS)]
            messages.append({"role": "user", "content": f"Tell me one more fact about {topic}."})
            reply = client.chat.completions.create(model="any", messages=messages,
                                                   max_tokens=24, temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        elapsed = time.perf_counter() - start
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        code = server.wait(timeout=120)
    print(json.dumps({"ranks": args.ranks, "requests": args.requests,
                      "elapsed_s": round(elapsed, 1), "exit_code": code, "samples": samples}))


if __name__ == "__main__":
    main()
