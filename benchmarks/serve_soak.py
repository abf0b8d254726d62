#!/usr/bin/env python3
"""Resident memory of `spmd-cp serve`'s ranks over many requests, against the memory
forecast: does it stay within the forecast, and flat once the resident caches are full?

    python benchmarks/serve_soak.py --ranks 2 --requests 100 --conversations 6 --turns 5

Requests cycle through more conversations than --cache-entries (4 by default), each
turn repeating its conversation so far, so entries are continued, copied and evicted all
along; a conversation starts again after --turns turns, so the tokens the caches hold
stop growing once every entry has had its longest conversation (the cache's budget, in
this workload). After every request /health's per-rank figures are recorded: resident
memory now and at its peak during the request (/proc), MLX's arrays in use and its
buffer cache, the resident KV, and that request's memory forecast (the busiest rank's:
prompt, max_tokens, the entries kept, MLX's buffer cache at its bound, the process
outside MLX), with the request's seconds; the report's table shows every --every-th.
Writes results/serve_soak.json and .md; prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from serve_followups import BIN, ENV, client_when_up, free_port  # noqa: E402

TOPICS = ["cats", "rivers", "bridges", "volcanoes", "violins", "glaciers", "comets"]
MB = 1 << 20


def start_server(ranks: int, port: int, log_path: Path):
    """The `spmd-cp serve` process group and an OpenAI client, once it answers."""
    with open(log_path, "wb") as log:
        server = subprocess.Popen([str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "spmd-cp"),
                                   "serve", "--port", str(port)], env=ENV, stderr=log,
                                  stdout=log, start_new_session=True)
    return server, client_when_up(server, port)


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as reply:
        return json.loads(reply.read())


def sample(port: int, requests: int, seconds: float) -> dict:
    state = health(port)
    ranks = [{name: round(value / MB, 1) for name, value in rank.items()}
             for rank in state["memory"]]
    forecast = {name.removesuffix("_bytes"): round(value / MB, 1)
                for name, value in state["memory_forecast"].items()}
    return {"requests": requests, "seconds": round(seconds, 2),
            "cache_tokens": state["cache"]["tokens"],
            "cache_entries": state["cache"]["entries"], "ranks": ranks, "forecast": forecast}


def margins(samples: list[dict], rank: int) -> dict:
    """The rank's resident memory against the forecast of the request just answered,
    over every sample (MB; negative: within the forecast)."""
    after = [s["ranks"][rank]["resident_bytes"] - s["ranks"][rank]["forecast_bytes"]
             for s in samples]
    peak = [s["ranks"][rank]["resident_peak_bytes"] - s["ranks"][rank]["forecast_bytes"]
            for s in samples]
    resident = [s["ranks"][rank]["resident_bytes"] for s in samples]
    return {"most_over_forecast_after": round(max(after), 1),
            "most_over_forecast_peak": round(max(peak), 1),
            "peak_resident": max(s["ranks"][rank]["resident_peak_bytes"] for s in samples),
            "first_resident": resident[0], "final_resident": resident[-1],
            "growth_first_to_last": round(resident[-1] - resident[0], 1)}


def slope_mb_per_100(samples: list[dict], rank: int, part) -> float:
    """Least-squares growth of ``part(rank figures)`` in MB per 100 requests."""
    xs = [s["requests"] for s in samples]
    ys = [part(s["ranks"][rank]) for s in samples]
    mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx_) ** 2 for x in xs) or 1
    return round(100 * sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / den, 1)


def outside_mlx(rank: dict) -> float:
    return rank["resident_bytes"] - rank["mlx_active_bytes"] - rank["mlx_cache_bytes"]


def report(result: dict, every: int) -> str:
    samples = result["samples"]
    lines = [bl.header("`spmd-cp serve`: resident memory per rank over "
                       f"{result['requests']} requests, N = {result['ranks']}",
                       result["command"]),
             f"{result['requests']} chat requests (24 greedy tokens each) cycling through "
             f"{result['conversations']} conversations of up to {result['turns']} turns, "
             "--cache-entries 4; the embedded SmolLM2-135M. Figures in MB per rank from "
             "/health after each request: resident now and its peak during the request, "
             "against that request's forecast (the busiest rank's). "
             f"{result['elapsed_s']} s in all; exit status {result['exit_code']} after "
             "SIGTERM.", ""]
    header = ["after requests", "cache tokens", "forecast (weights + KV + activations + "
              "process + buffer cache)"]
    for rank in range(result["ranks"]):
        header += [f"rank {rank} resident (request's peak)", f"rank {rank} MLX in use / cache",
                   f"rank {rank} KV"]
    rows = []
    for s in samples:
        if s["requests"] % every and s["requests"] != 1:
            continue
        f = s["forecast"]
        row = [s["requests"], s["cache_tokens"],
               f"{f['total']:.0f} ({f['weights']:.0f} + {f['kv']:.0f} + "
               f"{f['activations']:.0f} + {f['process']:.0f} + {f.get('buffer_cache', 0):.0f})"]
        for r in s["ranks"]:
            row += [f"{r['resident_bytes']:.0f} ({r['resident_peak_bytes']:.0f})",
                    f"{r['mlx_active_bytes']:.0f} / {r['mlx_cache_bytes']:.0f}",
                    f"{r['kv_bytes']:.1f}"]
        rows.append(row)
    lines.append(bl.table(header, rows))
    lines += ["", "Against the forecast, every request (MB; negative: within it):", ""]
    rows = [[rank, m["most_over_forecast_after"], m["most_over_forecast_peak"],
             m["first_resident"], m["final_resident"], m["peak_resident"]]
            for rank, m in enumerate(result["margins"])]
    lines.append(bl.table(["rank", "most over, after the request", "most over, the request's "
                           "peak", "resident after request 1", "after the last",
                           "highest peak"], rows))
    lines += ["", f"Growth from request {result['plateau_from']} on (the caches full; "
              "least squares, MB per 100 requests):", ""]
    rows = [[rank, *(result["growth_mb_per_100"][rank][k] for k in
                     ("resident", "outside_mlx", "mlx_active", "mlx_cache", "kv"))]
            for rank in range(result["ranks"])]
    lines.append(bl.table(["rank", "resident", "outside MLX", "MLX in use", "MLX cache",
                           "KV"], rows))
    seconds = sorted(s["seconds"] for s in samples)
    lines += ["", f"Seconds a request: median {seconds[len(seconds) // 2]}, "
              f"{seconds[0]} to {seconds[-1]}."]
    return "\n".join(lines)


def converse(client, args) -> list[dict]:
    """The requests; /health after each."""
    conversations = [[] for _ in range(args.conversations)]
    samples = []
    for index in range(args.requests):
        slot = index % args.conversations
        if len(conversations[slot]) >= 2 * args.turns:
            conversations[slot] = []
        messages = conversations[slot]
        topic = TOPICS[(index + len(messages)) % len(TOPICS)]
        messages.append({"role": "user", "content": f"Tell me one more fact about {topic}."})
        start = time.perf_counter()
        reply = client.chat.completions.create(model="any", messages=messages,
                                               max_tokens=24, temperature=0)
        seconds = time.perf_counter() - start
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        samples.append(sample(args.port, index + 1, seconds))
    return samples


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="the report's table: every "
                        "this many requests (all are in the JSON)")
    args = parser.parse_args()
    args.port = free_port()
    log_path = bl.RESULTS / "serve_soak.log"
    server, client = start_server(args.ranks, args.port, log_path)
    try:
        start = time.perf_counter()
        samples = converse(client, args)
        elapsed = time.perf_counter() - start
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        code = server.wait(timeout=120)
    log_path.unlink(missing_ok=True)
    # The caches are full once every conversation slot has restarted once.
    full_at = args.conversations * args.turns
    plateau = [s for s in samples if s["requests"] >= full_at] or samples[-2:]
    growth = [{"resident": slope_mb_per_100(plateau, r, lambda x: x["resident_bytes"]),
               "outside_mlx": slope_mb_per_100(plateau, r, outside_mlx),
               "mlx_active": slope_mb_per_100(plateau, r, lambda x: x["mlx_active_bytes"]),
               "mlx_cache": slope_mb_per_100(plateau, r, lambda x: x["mlx_cache_bytes"]),
               "kv": slope_mb_per_100(plateau, r, lambda x: x["kv_bytes"])}
              for r in range(args.ranks)]
    result = {"ranks": args.ranks, "requests": args.requests,
              "conversations": args.conversations, "turns": args.turns,
              "elapsed_s": round(elapsed, 1), "exit_code": code, "samples": samples,
              "plateau_from": plateau[0]["requests"], "growth_mb_per_100": growth,
              "margins": [margins(samples, r) for r in range(args.ranks)],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": bl.machine(),
              "command": "python benchmarks/serve_soak.py " + " ".join(sys.argv[1:])}
    bl.save("serve_soak", result, report(result, args.every))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
