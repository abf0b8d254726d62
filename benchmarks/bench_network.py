"""Prefill algorithms over a simulated 2-host TCP cluster at several link rates.

    python benchmarks/bench_network.py                         # rates 1, 4, 16 gbit
    python benchmarks/bench_network.py --rates 1gbit 4gbit --mix 2048:0 --mix 64:2048

Needs root (network namespaces). For each rate: ``launch/netns-cluster up 2 --rate R``,
then per new:cached mix one launch of benchmarks/prefill_worker.py through
``launch/spmd-cp-run --netns-cluster -n 2 --threads 1 --exec`` in which pass-kv, pass-q
and allgather-kv alternate for --rounds rounds (after a 64-token warm-up; the cached
prefix is prefilled once, untimed). Each launch also records what ``--cp-algo auto``
picks for the call: its calibration (attention FLOP/s C, ring bandwidth BW) is measured
on the ranks and cached per host set, so every rate gets a fresh SPMD_CP_CACHE directory
and auto measures that rate's link itself. ``netns-cluster down`` at the end (also on
failure).

The two simulated hosts share this machine's 2 cores (one rank each, 1 BLAS thread), so
this simulates the network, not more compute. tbf shapes bandwidth only (no delay); above
about 8gbit the shared cores running both TCP stacks, not the shaper, limit the link
(docs/LAUNCH.md section 5), so "16gbit" measures an unshaped-in-practice ~0.7 GB/s link.

Results: benchmarks/results/network.json and .md.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

WORKER = Path(__file__).with_name("prefill_worker.py")
CLUSTER = bl.ROOT / "launch" / "netns-cluster"
RUN = bl.ROOT / "launch" / "spmd-cp-run"
ALGOS = ["pass-kv", "pass-q", "allgather-kv"]


def cluster(*args):
    subprocess.run([str(CLUSTER), *args], check=True, capture_output=True, text=True)


def veth_bytes() -> int:
    """Bytes sent by the simulated hosts (their veth ends in the root namespace)."""
    total = 0
    for p in Path("/sys/class/net").glob("spmdcp-v*"):
        try:
            total += int((p / "statistics" / "rx_bytes").read_text())
        except OSError:
            pass
    return total


def run_mix(new, cached, rounds, cache_dir) -> dict:
    cmd = [bl.PYTHON, str(RUN), "--netns-cluster", "-n", "2", "--threads", "1",
           "--env", f"SPMD_CP_CACHE={cache_dir}", "--exec", "--", bl.PYTHON, str(WORKER),
           "--new", str(new), "--cached", str(cached), "--algo", *ALGOS, "--rounds",
           str(rounds), "--warmup", "--auto-choice"]
    before = veth_bytes()
    r = bl.run_json(cmd, env=bl.bench_env(1), timeout=3600)
    r["_veth_bytes"] = veth_bytes() - before
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "4gbit", "16gbit"])
    parser.add_argument("--mix", action="append", default=None, help="NEW:CACHED")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    args.mix = args.mix or ["2048:0", "64:2048"]
    command = "python benchmarks/bench_network.py " + shlex.join(sys.argv[1:])
    mixes = [tuple(int(x) for x in m.split(":")) for m in args.mix]

    runs = {}
    try:
        for rate in args.rates:
            cluster("up", "2", "--rate", rate)
            cache_dir = tempfile.mkdtemp(prefix=f"spmdcp-bench-cal-{rate}-")
            for mix in mixes:
                r = run_mix(*mix, args.rounds, cache_dir)
                runs[(rate, mix)] = r
                bl.log(f"{rate} {mix}: " + ", ".join(
                    f"{a} {min(r['results'][a]['times_s']):.2f}s" for a in ALGOS)
                    + f"; auto -> {r['auto']['algo']}")
    finally:
        subprocess.run([str(CLUSTER), "down"], capture_output=True)

    out = [bl.header("Prefill algorithms over a simulated 2-host TCP link", command)]
    out.append("`launch/netns-cluster up 2 --rate R` (tbf on every veth, per direction), "
               "MPICH over ofi/tcp; one rank per simulated host, 1 BLAS thread each, both "
               f"on this machine's 2 cores. Times: median of {args.rounds} alternating rounds "
               "inside one launch per mix (one launch per rate and mix; the rates run one "
               "after the other). BW and C: what auto's calibration measured at that rate "
               "(fresh SPMD_CP_CACHE per rate).\n")
    rows = []
    for (rate, mix), r in runs.items():
        times = {a: bl.median(r["results"][a]["times_s"]) for a in ALGOS}
        fastest = min(ALGOS, key=times.get)
        chosen = r["auto"]["algo"]
        m = r["auto"]["measured"] or {}
        mb = " / ".join(f"{max(r['results'][a]['comm_bytes']) / 2**20:.1f}" for a in ALGOS)
        waits = " / ".join(bl.fmt(max(bl.median(w) for w in r["results"][a]["wait_s"]))
                           for a in ALGOS)
        ratio = times[chosen] / times[fastest]
        ok = "yes" if chosen == fastest else (
            f"within 5% ({ratio:.3f}x)" if ratio <= 1.05
            else f"no: {chosen} is {ratio:.3f}x the fastest")
        rows.append([rate, mix[0], mix[1], bl.fmt(times["pass-kv"]), bl.fmt(times["pass-q"]),
                     bl.fmt(times["allgather-kv"]), fastest, chosen, ok,
                     f"{m.get('ring_bytes_per_s', 0) / 1e9:.3f}",
                     f"{m.get('attention_flops', 0) / 1e9:.1f}", mb, waits,
                     f"{r['_load'][0]:.1f}", f"{r['_others']:.2f}"])
    out.append(bl.table(["rate", "new", "cached", "pass-kv s", "pass-q s", "allgather-kv s",
                         "fastest", "auto chose", "auto = fastest?", "BW GB/s (auto's)",
                         "C GFLOP/s (auto's)", "MB sent/rank kv / q / ag",
                         "comm wait s kv / q / ag", "load avg", "others' cores"], rows))
    out.append("\nauto's reasons:\n\n" + "\n".join(
        f"- {rate} {mix[0]}:{mix[1]}: {r['auto']['reason']}" for (rate, mix), r in runs.items()))
    text = "\n".join(out)
    bl.save("network", {"args": vars(args), "machine": bl.machine(),
                        "runs": {f"{rate}|{m[0]}:{m[1]}": v for (rate, m), v in runs.items()}},
            text)
    print(text)


if __name__ == "__main__":
    main()
