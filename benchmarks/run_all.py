"""Regenerate every figure of docs/BENCHMARKS.md, one benchmark after the other.

    python benchmarks/run_all.py                  # everything (~100 min on 2 idle cores)
    python benchmarks/run_all.py --only decode soak
    python benchmarks/run_all.py --skip network   # e.g. without root

Each step is the exact command quoted next to its table in docs/BENCHMARKS.md; each writes
benchmarks/results/<name>.json (raw numbers) and <name>.md (the printed tables, with the
machine description and load average), and the last step draws docs/benchmarks.png
from the results. The steps run one at a time: they time things, and share the machine
with nothing of their own. Before every measured launch the drivers wait up to
$BENCH_QUIET_WAIT seconds (default 20) for other processes to go quiet, and they record
how many cores others used anyway.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable

STEPS = {
    "prefill-scaling": [PY, HERE / "bench_prefill.py", "scaling", "--new", "3072", "--ranks",
                        "1", "2", "--rounds", "3", "--profile"],
    "prefill-algos": [PY, HERE / "bench_prefill.py", "algos", "--ranks", "2", "--mix", "2048:0",
                      "--mix", "128:2048", "--rounds", "2"],
    "decode": [PY, HERE / "bench_decode.py", "--contexts", "16", "2048", "4096", "8192",
               "--ranks", "1", "2", "4", "--rounds", "3"],
    # As root, also N = 2 over 2 simulated hosts (TCP through veth links capped at 16 gbit).
    "vs-mlx-lm": [PY, HERE / "bench_vs_mlx_lm.py", "--sizes", "1024", "2048", "4096", "8160",
                  "--ranks", "1", "2", "4", "--rounds", "2", "--rounds-long", "1"]
                 + (["--cluster-rate", "16gbit"] if os.geteuid() == 0 else []),
    "network": [PY, HERE / "bench_network.py", "--rates", "1gbit", "4gbit", "16gbit",
                "--mix", "2048:0", "--mix", "64:2048", "--rounds", "2"],
    "soak": [PY, HERE / "soak.py", "--generations", "200", "--jobs", "20"],
    "decode-overhead": [PY, HERE / "decode_overhead.py", "--context", "1024"],
    "decode-overhead-4k": [PY, HERE / "decode_overhead.py", "--context", "4096"],
    "generate": [PY, HERE / "bench_generate.py", "--ranks", "1", "2", "4", "--rounds", "2"],
    "long-greedy": [PY, HERE / "check_long_greedy.py", "--lengths", "500", "3000", "--tokens",
                    "128", "--ranks", "1", "2", "3", "4"],
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
