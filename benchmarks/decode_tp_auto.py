"""`--decode-tp auto` against `on` and `off` at N ranks, with a calibration file on disk
that is far off (a file written while the machine was busy, say).

    python benchmarks/decode_tp_auto.py                      # N = 2, 3 rounds, 20x off
    python benchmarks/decode_tp_auto.py --rounds 5 --factor 20 --ranks 2

A warm-up run measures and caches the calibration in a fresh $SPMD_CP_CACHE; the file is
then doctored (one collective ``factor`` times slower, weight reads ``factor`` times
slower) and copied back before every measured run, so each run of `auto` meets the
stale file. Every round runs `on`, `off` and `auto` in turn (interleaved), each

    OPENBLAS_NUM_THREADS=1 mpiexec -n N spmd-cp generate --prompt-file gpl.txt \\
        --max-tokens 64 --json --decode-tp MODE

(gpl.txt: the first 12,000 bytes of /usr/share/common-licenses/GPL-3, else
benchmarks/results/prompts/prompt_4096.txt). Reported: decode tok/s per run, the layout
each run took (the decode plan), the medians and `auto`'s median over the faster of the
`on` and `off` medians. Results: benchmarks/results/decode_tp_auto_stale_calibration.*.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl

GPL = Path("/usr/share/common-licenses/GPL-3")
FALLBACK = Path(__file__).resolve().parent / "results" / "prompts" / "prompt_4096.txt"
MODES = ("on", "off", "auto")


def run(ranks: int, mode: str, prompt: Path, tokens: int, env: dict) -> dict:
    cmd = bl.mpi_cmd(ranks, bl.SPMD_CP, "generate", "--prompt-file", str(prompt),
                     "--max-tokens", str(tokens), "--json", "--decode-tp", mode)
    result = bl.run_json(cmd, env=env, cwd=prompt.parent, quiet_wait=0)
    plan = result.get("decode_plan") or {}
    row = {"mode": mode, "decode_tp": result["decode_tp"], "decode_tok_s": result["decode_tok_s"],
           "tokens": result["tokens"], "prompt_tokens": result["prompt_tokens"],
           "collective_s_used": (plan.get("inputs") or {}).get("collective_s"),
           "load_before": result["_load"][0]}
    bl.log(f"{mode}: chose {row['decode_tp']}, decode {row['decode_tok_s']:.2f} tok/s")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--factor", type=float, default=20.0,
                        help="how far off the doctored calibration file is")
    parser.add_argument("--name", default="decode_tp_auto_stale_calibration")
    args = parser.parse_args()
    command = "python benchmarks/decode_tp_auto.py " + shlex.join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="decode-tp-auto-") as tmp:
        prompt = Path(tmp) / "gpl.txt"
        prompt.write_bytes(GPL.read_bytes()[:12000] if GPL.is_file() else FALLBACK.read_bytes())
        cache = Path(tmp) / "cache"
        env = bl.bench_env(1, SPMD_CP_CACHE=str(cache))
        bl.run_json(bl.mpi_cmd(args.ranks, bl.SPMD_CP, "generate", "--prompt", "Hello",
                               "--max-tokens", "4", "--json"), env=env, cwd=tmp, quiet_wait=0)
        (path,) = cache.glob("calibration-v*-*.json")
        measured = json.loads(path.read_text())
        doctored = {**measured, "collective_s": measured["collective_s"] * args.factor,
                    "stream_bytes_per_s": measured["stream_bytes_per_s"] / args.factor}
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        runs = {mode: [] for mode in MODES}
        for round_ in range(1, args.rounds + 1):
            for mode in MODES:
                path.write_text(json.dumps(doctored))
                runs[mode].append({"round": round_, **run(args.ranks, mode, prompt,
                                                           args.tokens, env)})
    medians = {mode: bl.median([r["decode_tok_s"] for r in rows]) for mode, rows in runs.items()}
    faster = max(medians["on"], medians["off"])
    rows = [[mode, ", ".join(sorted({r["decode_tp"] for r in runs[mode]})),
             ", ".join(f"{r['decode_tok_s']:.1f}" for r in runs[mode]),
             f"{medians[mode]:.1f}", f"{medians[mode] / faster:.2f}"] for mode in MODES]
    markdown = "\n\n".join([
        bl.header(f"--decode-tp auto with a calibration file {args.factor:g}x off", command),
        f"started {started}; N = {args.ranks}, 1 BLAS thread per rank, {args.tokens} greedy "
        f"tokens, the embedded SmolLM2-135M; the file held "
        f"{1e6 * doctored['collective_s']:.0f} us per collective and "
        f"{doctored['stream_bytes_per_s'] / 1e9:.2f} GB/s of weight reads (measured: "
        f"{1e6 * measured['collective_s']:.0f} us, "
        f"{measured['stream_bytes_per_s'] / 1e9:.1f} GB/s)",
        bl.table(["--decode-tp", "chose", "decode tok/s per round", "median",
                  "x the faster of on/off"], rows)])
    print(markdown)
    bl.save(args.name, {"command": command, "machine": bl.machine(), "started": started,
                        "calibration_measured": measured, "calibration_doctored": doctored,
                        "runs": runs, "medians": medians,
                        "auto_over_faster": medians["auto"] / faster}, markdown)


if __name__ == "__main__":
    main()
