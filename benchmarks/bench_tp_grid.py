"""CP x TP layouts (``--tp``) side by side: prefill and decode speed, bytes sent per token,
weights and KV a rank.

    python benchmarks/bench_tp_grid.py [--chars 8000] [--tokens 33] [--rounds 1] \\
        [--rate 1gbit]

Every run is ``spmd-cp generate --prompt-file DOC --no-chat-template --max-tokens T
--ignore-eos --json`` on the embedded SmolLM2 with its default flags otherwise, once with
``--max-tokens 1`` (the prefill alone: its bytes) and once with T (the decode's bytes are
the difference). Layouts, in turn, each round:

- here, N = 2 over shared memory: CP 2 (``--tp 1``), TP 2 (``--tp 2``), and TP 2 holding
  MLX's quantized form of the file's blocks (``--tp 2 --keep-quantized``);
- with ``--rate R``, N = 4 on the simulated two-host TCP cluster (``launch/netns-cluster
  up 2 --rate R --slots 2``: ranks 0-1 on one host, 2-3 on the other; needs root): CP 4
  (every rank's ring crosses hosts) against CP 2 x TP 2 (each TP group on one host, the CP
  ring between hosts).

Results: benchmarks/results/tp_grid.json and .md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import benchlib as bl  # noqa: E402

GPL = Path("/usr/share/common-licenses/GPL-3")
FALLBACK = bl.RESULTS / "prompts" / "prompt_4096.txt"
CLUSTER = REPO / "launch" / "netns-cluster"
LOCAL = {"CP 2": ["--tp", "1"], "TP 2": ["--tp", "2"],
         "TP 2, quantized": ["--tp", "2", "--keep-quantized"]}
TWO_HOSTS = {"CP 4": ["--tp", "1"], "CP 2 x TP 2": ["--tp", "2"]}


def launch(ranks: int, doc: Path, tokens: int, flags: list[str], cluster: bool) -> dict:
    args = ["generate", "--prompt-file", str(doc), "--no-chat-template", "--max-tokens",
            str(tokens), "--ignore-eos", "--json", *flags]
    return bl.run_json(bl.spmd_cp_command(ranks, args, cluster), env=bl.bench_env(1),
                       timeout=1800)


def measure(ranks: int, doc: Path, tokens: int, flags: list[str], cluster: bool) -> dict:
    """One layout: the prefill alone, then prefill and decode."""
    prefill = launch(ranks, doc, 1, flags, cluster)
    full = launch(ranks, doc, tokens, flags, cluster)
    prompt, decoded = full["prompt_tokens"], full["tokens"] - 1
    prefill_bytes = sum(prefill["comm_bytes"])
    return {"prompt_tokens": prompt, "ttft_s": full["ttft_s"],
            "prefill_tok_s": full["prefill_tok_s"], "decode_tok_s": full["decode_tok_s"],
            "prefill_bytes_per_token": prefill_bytes / prompt,
            "decode_bytes_per_token": (sum(full["comm_bytes"]) - prefill_bytes) / decoded,
            "model_bytes": full["model_bytes"], "kv_cache_bytes": full["kv_cache_bytes"],
            "decode_plan": full["decode_plan"], "token_ids": full["token_ids"],
            "others_cores": full["_others"]}


def rounds_of(layouts: dict, ranks: int, doc: Path, tokens: int, rounds: int,
              cluster: bool) -> dict:
    runs = {name: [] for name in layouts}
    for _ in range(rounds):
        for name, flags in layouts.items():
            bl.log(f"{name} at N = {ranks}{' (two hosts)' if cluster else ''}")
            runs[name].append(measure(ranks, doc, tokens, flags, cluster))
    return runs


def summary_rows(runs: dict) -> list[list]:
    first = next(iter(runs.values()))[0]
    rows = []
    for name, each in runs.items():
        med = lambda key: bl.median(r[key] for r in each)  # noqa: E731
        rows.append([name, bl.fmt(med("prefill_tok_s"), 1), bl.fmt(med("decode_tok_s"), 1),
                     bl.fmt(med("prefill_bytes_per_token") / 1e3, 1),
                     bl.fmt(med("decode_bytes_per_token") / 1e3, 1),
                     bl.fmt(max(each[0]["model_bytes"]) / 2**20, 0),
                     bl.fmt(max(each[0]["kv_cache_bytes"]) / 2**20, 1),
                     "yes" if each[0]["token_ids"] == first["token_ids"] else "no"])
    return rows


HEADER = ["layout", "prefill tok/s", "decode tok/s", "prefill KB sent / token",
          "decode KB sent / token", "weights MiB a rank (max)", "KV MiB a rank (max)",
          "tokens = first layout's"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=8000, help="document characters")
    parser.add_argument("--tokens", type=int, default=33, help="tokens generated")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", default=None, help="the two-host cluster's link rate")
    args = parser.parse_args()
    command = bl.command_line("bench_tp_grid.py", sys.argv[1:])
    with tempfile.TemporaryDirectory() as scratch:
        doc = Path(scratch) / "document.txt"
        doc.write_text((GPL if GPL.is_file() else FALLBACK).read_text()[:args.chars])
        local = rounds_of(LOCAL, 2, doc, args.tokens, args.rounds, cluster=False)
        two_hosts = None
        if args.rate:
            try:
                subprocess.run([str(CLUSTER), "up", "2", "--rate", args.rate, "--slots", "2"],
                               check=True, capture_output=True, text=True)
                two_hosts = rounds_of(TWO_HOSTS, 4, doc, args.tokens, args.rounds, True)
            finally:
                subprocess.run([str(CLUSTER), "down"], capture_output=True)
    text = bl.header("CP x TP layouts", command)
    text += "\n### N = 2, one host (shared memory)\n\n" + bl.table(HEADER, summary_rows(local))
    if two_hosts:
        text += (f"\n\n### N = 4, two simulated hosts at {args.rate} (2 ranks a host)\n\n"
                 + bl.table(HEADER, summary_rows(two_hosts)))
    print(text)
    bl.save("tp_grid", {"command": command, "machine": bl.machine(), "local": local,
                        "two_hosts": two_hosts, "rate": args.rate}, text)


if __name__ == "__main__":
    main()
