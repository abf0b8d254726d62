"""Re-run every table of docs/BENCHMARKS.md and the measured gains of docs/CPU_SPEED.md.

    python benchmarks/run_all.py                  # everything (about 90 min on 2 idle cores)
    python benchmarks/run_all.py --only generate vs-mlx-lm
    python benchmarks/run_all.py --skip network   # e.g. without root

Each step is the command quoted beside its row in docs/BENCHMARKS.md (or docs/CPU_SPEED.md
for the ``knob-*`` steps); each writes benchmarks/results/<name>.json (raw numbers) and
<name>.md (the printed tables, with the machine description and load average), the same
file the docs cite, and the last step draws docs/benchmarks.png from the results. The steps
run one at a time: they time things, and share the machine with nothing of their own.
Before every measured launch the drivers wait up to $BENCH_QUIET_WAIT seconds (default 20)
for other processes to go quiet, and they record how many cores others used anyway.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable
GENERATE = [PY, HERE / "bench_generate.py", "--ranks", "1", "2", "--tokens", "64"]


def knob(other: str, name: str, rounds: str = "3", *extra: str) -> list:
    """The command users run with the shipped setting and with ``other`` beside it: a
    start-up variable (NAME=VALUE) or generate flags (starting with --)."""
    compare = "--compare-flags=" + other if other.startswith("--") else "--compare-env=" + other
    return GENERATE + ["--rounds", rounds, *extra, compare, "--baseline-ranks", "1", "2",
                       "--name", name]


STEPS = {
    # docs/BENCHMARKS.md, the table of the current code
    "generate": GENERATE + ["--rounds", "3"],
    "vs-mlx-lm": [PY, HERE / "bench_vs_mlx_lm.py", "--sizes", "1024", "4096", "--ranks", "1",
                  "2", "--rounds", "2", "--skip-memory"],
    # docs/BENCHMARKS.md, the checks on record
    "long-greedy": [PY, HERE / "check_long_greedy.py", "--lengths", "500", "3000", "--tokens",
                    "128", "--ranks", "1", "2", "3", "4"],
    "soak": [PY, HERE / "soak.py", "--generations", "200", "--jobs", "20"],
    "prefill-algos": [PY, HERE / "bench_prefill.py", "algos", "--ranks", "2", "--mix", "2048:0",
                      "--mix", "128:2048", "--rounds", "2"],
    # needs root (network namespaces)
    "network": [PY, HERE / "bench_network.py", "--rates", "1gbit", "4gbit", "16gbit",
                "--mix", "2048:0", "--mix", "64:2048", "--rounds", "2"],
    # docs/CPU_SPEED.md, the knobs' measured gains
    "knob-fast-exp": knob("--no-fast-exp", "generate_fast_exp_off", "2"),
    "knob-fast-exp-8k": knob("--no-fast-exp", "generate_fast_exp_off_8k", "1",
                             "--prompt-tokens", "7900"),
    "knob-sched": knob("SPMD_CP_SCHED=default", "generate_sched_default"),
    "knob-huge-pages": knob("SPMD_CP_HUGE_PAGES=off", "generate_huge_pages_off"),
    # glibc is the default: the other allocator is the one compared
    "knob-allocator": knob("SPMD_CP_ALLOCATOR=jemalloc", "generate_allocator"),
    "knob-quantized-decode": knob("--no-quantized-decode", "generate_quantized_decode_off"),
    "decode-tp-auto": [PY, HERE / "decode_tp_auto.py", "--rounds", "3"],
    "plot": [PY, HERE / "plot.py"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(STEPS))
    parser.add_argument("--skip", nargs="+", choices=list(STEPS), default=[])
    args = parser.parse_args()
    steps = [s for s in (args.only or STEPS) if s not in args.skip]
    if "plot" not in steps and not args.only:
        steps.append("plot")
    timings = {}
    for name in steps:
        cmd = [str(c) for c in STEPS[name]]
        print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        result = subprocess.run(cmd)
        timings[name] = time.perf_counter() - start
        if result.returncode != 0:
            print(f"=== {name} failed with exit status {result.returncode}", flush=True)
    print("\n" + "\n".join(f"{k}: {v / 60:.1f} min" for k, v in timings.items()))


if __name__ == "__main__":
    main()
