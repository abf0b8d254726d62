"""spmd-cp versus mlx-lm on the same model, weights and machine, side by side.

    python benchmarks/bench_vs_mlx_lm.py                         # sizes 1K 2K 4K 8K, N = 1 2 4
    python benchmarks/bench_vs_mlx_lm.py --sizes 1024 2048 --ranks 1 2 --rounds 2
    python benchmarks/bench_vs_mlx_lm.py --only-memory           # forecast table + check only

For each prompt size (random-ish English-like text cut to exactly that many tokens of the
model's tokenizer), in every round, alternating:

(a) mlx-lm: a fresh process that calls spmd_cp.blas.ensure_fast_blas() (OpenBLAS, like
    spmd-cp, but without spmd-cp's matrix-vector forward, SPMD_CP_GEMV_FORWARD=0: mlx-lm
    as its users run it on OpenBLAS; --mlx-lm-forward gives it the forward too), loads the model with spmd_cp.models.loader.load_model (the same dequantized float32
    weights) and runs mlx-lm's own ``generate_step`` (its default prefill_step_size 2048)
    greedily for --max-tokens tokens, without stopping at EOS;
(b) ``mpiexec -n N spmd-cp generate --prompt-file F --json --no-chat-template
    --kv-dtype float32 --max-tokens 32`` for each N (mlx-lm's cache dtype) (greedy; stops at EOS, which random text rarely yields).

BLAS threads are left to the programs (both pick cores / ranks per node: 2 for mlx-lm
and N = 1, 1 for N = 2 and 4); N = 4 on 2 cores is oversubscribed. Reported: TTFT,
prefill tokens/s, decode tokens/s (tokens after the first / time after the first),
peak MLX memory (mx.get_peak_memory after the model is loaded: weights + KV + activations)
per rank, peak RSS per process (sampled from /proc every 0.2 s: VmHWM), and how many
leading characters of the greedy continuation agree with mlx-lm's.

With ``--cluster-rate R`` (root: network namespaces), also (c) ``spmd-cp N=2 TCP``: the
same spmd-cp command on 2 simulated hosts (``launch/netns-cluster up 2 --rate R``, both on
this machine's 2 cores, links capped at R) through ``launch/spmd-cp-run --netns-cluster
--threads 1``, so the ranks talk TCP instead of shared memory.

Then the memory forecast (spmd_cp.engine.cache.forecast.forecast_rank_bytes, the check behind
--memory-limit): the longest context that fits --budget per rank for N = 1, 2, 4, 8, with
the whole prompt in one prefill call and with --prefill-chunk 1024; and an empirical check
of the N = 1 point: spmd-cp run with --memory-limit just under and just over it.

Results: benchmarks/results/<--name>.json and .md (default vs_mlx_lm; with --only-memory:
vs_mlx_lm_memory.*).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are "
         "his her their its had have has not but were been one all they we there more when "
         "who will would can about into other than some time people new first after may "
         "only over also years such made most city world state two three house river "
         "system number history music water school century market light report program "
         "island station theory machine garden letter summer winter mountain village "
         "engine paper model signal company council science family animal color morning "
         "problem answer window forest street bridge ocean planet memory network energy "
         "between during under against without before through because while although").split()


def make_prompt(tokenizer, tokens: int, seed: int) -> tuple[str, int]:
    """Random-ish text whose tokenization is ``tokens`` long (or within a token or two)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    sentences = []
    while True:
        length = rng.randint(6, 18)
        words = [WORDS[i] for i in rng.randint(0, len(WORDS), size=length)]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", ",", ";", "?"]))
        if len(sentences) % 50 == 0 and len(tokenizer.encode(" ".join(sentences))) > tokens + 16:
            break
    ids = tokenizer.encode(" ".join(sentences))[:tokens]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


# -- (a) the mlx-lm child ---------------------------------------------------------------
def mlx_lm_child(args):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from spmd_cp.blas import describe_blas
    from spmd_cp.models.loader import default_model_path, load_model

    loaded = load_model(default_model_path())
    model, tokenizer = loaded.model, loaded.tokenizer
    text = Path(args.prompt_file).read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    prompt = mx.array(ids)
    mx.reset_peak_memory()
    sampler = make_sampler(0.0)
    tokens, stamps = [], []
    start = time.perf_counter()
    for token, _ in generate_step(prompt, model, max_tokens=args.max_tokens, sampler=sampler):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    decode_s = stamps[-1] - stamps[0]
    rss = bl.proc_status(os.getpid())
    print(json.dumps({
        "prompt_tokens": len(ids), "tokens": len(tokens), "ttft_s": ttft,
        "prefill_tok_s": len(ids) / ttft,
        "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else 0.0,
        "peak_mem_bytes": [int(mx.get_peak_memory())], "rss_hwm": rss.get("VmHWM"),
        "text": tokenizer.decode(tokens), "blas": describe_blas().get("line")}))


# -- (b) spmd-cp, (c) spmd-cp over simulated hosts --------------------------------------
CLUSTER = bl.ROOT / "launch" / "netns-cluster"
RUN = bl.ROOT / "launch" / "spmd-cp-run"
TCP_CONFIG = "spmd-cp N=2 TCP"


def generate_args(prompt_file: str, max_tokens: int, *extra) -> list:
    # mlx-lm's cache of a float32 model is float32: the same here, so that the texts
    # compared character by character come from the same arithmetic
    return ["generate", "--prompt-file", prompt_file, "--json", "--no-chat-template",
            "--kv-dtype", "float32", "--max-tokens", max_tokens, *extra]


def spmd_cp_cmd(ranks: int, prompt_file: str, max_tokens: int, *extra) -> list[str]:
    return bl.mpi_cmd(ranks, bl.SPMD_CP, *generate_args(prompt_file, max_tokens, *extra))


def tcp_cmd(prompt_file: str, max_tokens: int) -> list[str]:
    return [bl.PYTHON, str(RUN), "--netns-cluster", "-n", "2", "--threads", "1", "--",
            *map(str, generate_args(prompt_file, max_tokens))]


def measure(args, configs: list[str], prompts: dict, runs: dict):
    """Every configuration on every prompt; configurations alternate within each round."""
    for rnd in range(max(args.rounds, args.rounds_long)):
        for size in args.sizes:
            if rnd >= (args.rounds if size < args.long_at else args.rounds_long):
                continue
            path = prompts[size][0]
            for config in configs:
                env = bl.bench_env(None)
                if config == "mlx-lm":
                    cmd = [bl.PYTHON, __file__, "--mlx-lm-child", "--prompt-file", path,
                           "--max-tokens", str(args.max_tokens)]
                    if not args.mlx_lm_forward:
                        env["SPMD_CP_GEMV_FORWARD"] = "0"
                elif config == TCP_CONFIG:
                    cmd = tcp_cmd(path, args.max_tokens)
                else:
                    cmd = spmd_cp_cmd(int(config.split("=")[1]), path, args.max_tokens)
                r = bl.run_json(cmd, env=env, timeout=7200)
                runs[(size, config)].append(r)
                bl.log(f"round {rnd + 1}: {size} tokens, {config}: ttft {r['ttft_s']:.1f}s, "
                       f"decode {r['decode_tok_s']:.1f} tok/s, others {r['_others']:.2f}")


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def longest_fitting(shape, weights, n, chunk, budget, algo="pass-kv") -> int:
    from spmd_cp.engine.cache.forecast import forecast_rank_bytes

    lo, hi = 0, 10**8
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if forecast_rank_bytes(shape, weights, mid, chunk or mid, n, algo).total <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def memory_section(args, shape, weights, prompts_dir: Path) -> tuple[str, dict]:
    from spmd_cp.engine.cache.forecast import SAFETY, forecast_rank_bytes, parse_bytes

    budget = parse_bytes(args.budget)
    out = [f"\n### Longest context within {args.budget} per rank (memory forecast)\n",
           "spmd_cp.engine.cache.forecast.forecast_rank_bytes (weights + KV shard + activations "
           f"of one prefill call, x{SAFETY} safety on activations), pass-kv, float32. The model itself "
           "is trained for 8192 positions; longer contexts are arithmetic here.\n"]
    rows, data = [], {}
    for n in args.forecast_ranks:
        whole = longest_fitting(shape, weights, n, 0, budget)
        chunked = longest_fitting(shape, weights, n, 1024, budget)
        f = forecast_rank_bytes(shape, weights, whole, whole, n, "pass-kv")
        data[n] = {"whole": whole, "chunk1024": chunked}
        rows.append([n, whole, chunked, f"{weights / 2**20:.0f}", f"{f.kv / 2**20:.0f}",
                     f"{f.activations / 2**20:.0f}"])
    out.append(bl.table(["ranks", "longest context, one prefill call",
                         "longest context, --prefill-chunk 1024",
                         "weights MiB", "KV MiB (one call)", "activations MiB (one call)"],
                        rows))
    if args.skip_verify:
        return "\n".join(out), {"forecast": data}
    # Empirical check at N = 1: the forecast counts prompt + --max-tokens tokens.
    limit = data[1]["whole"]
    mt = args.max_tokens
    under, over = limit - mt - 40, limit - mt + 40

    checks = {}
    for label, tokens in (("under", under), ("over", over)):
        path = prompts_dir / f"budget_{tokens}.txt"
        path.write_text(args._prompt_maker(tokens))
        r = bl.run_json(spmd_cp_cmd(1, str(path), mt, "--memory-limit", args.budget),
                        env=bl.bench_env(None), check=False)
        checks[label] = {"tokens": tokens, "returncode": r["_returncode"],
                         "peak_mem_bytes": r.get("peak_mem_bytes"), "rss": r["_rss_peaks"],
                         "stderr": r.get("_stderr", "")[-600:], "ttft_s": r.get("ttft_s"),
                         "prompt_tokens": r.get("prompt_tokens")}
        bl.log(f"memory check {label}: {tokens} tokens -> exit {r['_returncode']}")
    u, o = checks["under"], checks["over"]
    refusal = next((line for line in o["stderr"].splitlines() if "error" in line), o["stderr"])
    out.append(f"\nCheck at N = 1, `--memory-limit {args.budget}`, --max-tokens {mt}: the "
               f"forecast allows {limit} tokens (prompt + generated).\n")
    peak = (u["peak_mem_bytes"] or [0])[0]
    out.append(f"- just under ({u['prompt_tokens'] or u['tokens']} prompt tokens): exit "
               f"{u['returncode']}, measured peak MLX memory {peak / 2**20:.0f} MiB "
               f"({100 * peak / budget:.0f}% of the budget), peak RSS "
               f"{max(u['rss'] or [0]) / 2**20:.0f} MiB")
    out.append(f"- just over ({o['tokens']} prompt tokens): exit {o['returncode']}: "
               f"`{refusal.strip()}`")
    return "\n".join(out), {"forecast": data, "checks": checks, "budget": budget}


def speed_section(args, tokenizer, prompts_dir: Path) -> tuple[str, dict]:
    """Every configuration on every prompt size, in alternating rounds: the table."""
    prompts = {}
    for size in args.sizes:
        text, actual = make_prompt(tokenizer, size, seed=size)
        path = prompts_dir / f"prompt_{size}.txt"
        path.write_text(text)
        prompts[size] = (str(path), actual)
    configs = ["mlx-lm"] + [f"spmd-cp N={n}" for n in args.ranks]
    if args.cluster_rate:
        configs.append(TCP_CONFIG)
        subprocess.run([str(CLUSTER), "up", "2", "--rate", args.cluster_rate], check=True)
    runs = {(s, c): [] for s in args.sizes for c in configs}
    try:
        measure(args, configs, prompts, runs)
    finally:
        if args.cluster_rate:
            subprocess.run([str(CLUSTER), "down"], capture_output=True)
    out = ["Prompts: random English-like text cut to the given number of tokens "
           "(no chat template), 32 greedy tokens. Median over rounds "
           f"({args.rounds} below {args.long_at} tokens, {args.rounds_long} from there on; "
           "configurations alternate within a round). Peak MLX memory: the largest rank's. "
           "Peak RSS: the largest process's VmHWM (includes the model load).\n"]
    if args.cluster_rate:
        out.append(f"{TCP_CONFIG}: 2 simulated hosts, links capped at {args.cluster_rate}, "
                   "both hosts on this machine's 2 cores, 1 BLAS thread per rank.\n")
    out.append(speed_table(args.sizes, configs, runs))
    return "\n".join(out), runs


def speed_table(sizes, configs, runs) -> str:
    def med(size, config, key):
        return bl.median(r[key] for r in runs[(size, config)])

    rows = []
    for size in sizes:
        ref = {k: med(size, "mlx-lm", k) for k in ("ttft_s", "prefill_tok_s", "decode_tok_s")}
        ref_text = runs[(size, "mlx-lm")][0]["text"]
        ref_peak = bl.median(max(r["peak_mem_bytes"]) for r in runs[(size, "mlx-lm")])
        for config in configs:
            rs = runs[(size, config)]
            peak = bl.median(max(r["peak_mem_bytes"]) for r in rs)
            rss = bl.median(max(r["_rss_peaks"] or [0]) for r in rs)
            agree = common_prefix(rs[0]["text"], ref_text)
            ttft, pre, dec = (med(size, config, k) for k in
                              ("ttft_s", "prefill_tok_s", "decode_tok_s"))
            rows.append([rs[0]["prompt_tokens"], config, bl.fmt(ttft), f"{pre:.0f}",
                         bl.fmt(pre / ref["prefill_tok_s"]), f"{dec:.1f}",
                         bl.fmt(dec / ref["decode_tok_s"]), f"{peak / 2**20:.0f}",
                         bl.fmt(peak / ref_peak), f"{rss / 2**20:.0f}",
                         f"{agree}/{len(ref_text)}",
                         f"{bl.median(r['_load'][0] for r in rs):.1f}",
                         f"{max(r['_others'] for r in rs):.2f}"])
    return bl.table(["prompt tokens", "run", "TTFT s", "prefill tok/s", "x mlx-lm",
                     "decode tok/s", "x mlx-lm", "peak MLX MiB/rank", "x mlx-lm",
                     "peak RSS MiB/process", "chars = mlx-lm", "load avg",
                     "others' cores (max)"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8160])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2, help="rounds for sizes < --long-at")
    parser.add_argument("--rounds-long", type=int, default=1, help="rounds for the others")
    parser.add_argument("--long-at", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget", default="1GB")
    parser.add_argument("--forecast-ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--cluster-rate", help="also run N=2 on simulated hosts (e.g. 16gbit)")
    parser.add_argument("--skip-memory", action="store_true", help="no forecast section")
    parser.add_argument("--name", default="vs_mlx_lm", help="results file name")
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--mlx-lm-forward", action="store_true",
                        help="give mlx-lm spmd-cp's matrix-vector forward too")
    parser.add_argument("--only-memory", action="store_true")
    parser.add_argument("--mlx-lm-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mlx_lm_child:
        from spmd_cp.blas import ensure_fast_blas

        ensure_fast_blas()
        mlx_lm_child(args)
        return
    command = "python benchmarks/bench_vs_mlx_lm.py " + shlex.join(sys.argv[1:])

    from spmd_cp.cli.steps import model_nbytes
    from spmd_cp.models.loader import default_model_path, load_model

    loaded = load_model(default_model_path())
    tokenizer, shape, weights = loaded.tokenizer, loaded.shape, model_nbytes(loaded.model)
    del loaded
    prompts_dir = bl.RESULTS / "prompts"
    prompts_dir.mkdir(parents=True, exist_ok=True)
    args._prompt_maker = lambda n: make_prompt(tokenizer, n, seed=n)[0]
    out = [bl.header("spmd-cp versus mlx-lm (SmolLM2-135M, float32, OpenBLAS)", command)]

    runs: dict = {}
    if not args.only_memory:
        speed_text, runs = speed_section(args, tokenizer, prompts_dir)
        out.append(speed_text)
    mem_text, mem_data = "", {}
    if not args.skip_memory:
        mem_text, mem_data = memory_section(args, shape, weights, prompts_dir)
        out.append(mem_text)
    text = "\n".join(out)
    bl.save("vs_mlx_lm_memory" if args.only_memory else args.name, {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                          "machine": bl.machine(), "memory": mem_data,
                          "runs": {f"{s}|{c}": v for (s, c), v in runs.items()}}, text)
    print(text)


if __name__ == "__main__":
    main()
