"""Attention-FFN disaggregation (``--afd``) against context parallelism alone: prefill and
decode speed, bytes crossing between the sides per token, weights and KV a rank, the
straggler summary, one micro-batch against two.

    python benchmarks/bench_afd.py [--chars 6000] [--tokens 17] [--rounds 3] [--rate 1gbit]

Every run is ``spmd-cp generate --prompt-file DOC --no-chat-template --max-tokens T
--ignore-eos --kv-dtype float32 --json`` with default flags otherwise, on two models: the
embedded SmolLM2-135M (dense) and a random-weight Qwen3-MoE written here (12 layers,
hidden 576, 16 experts of 512 hidden units, 2 a token: 0.21 B parameters, 0.19 B of
them experts; the embedded model's tokenizer). Layouts, each:

- here, N = 3 over shared memory: CP 3; ``--afd 2:1`` in one micro-batch and in two;
Then batched decode (``spmd-cp batch --max-batch 8 --kv-dtype float32 --json``, N = 3
here): 8 jobs of 24 tokens (``ignore_eos``) after the document's first 2,500 characters
as a shared prefix, CP 3 against ``--afd 2:1`` with one micro-batch and with two (each
batched step then two halves, one's attention while the FFN rank computes the other's
MLP): the aggregate decode tok/s, and whether every job's tokens equal CP 3's.

Rounds interleave the layouts; the tables give medians.

- with ``--rate R``, N = 4 on the simulated two-host TCP cluster (``launch/netns-cluster
  up 2 --rate R --slots 2``: ranks 0-1 on one host, 2-3 on the other; needs root): CP 4
  against ``--afd 2:2`` (the attention ranks on one host, the FFN ranks on the other:
  every layer's rows cross the link).

Results: benchmarks/results/afd.json and .md.
"""

from __future__ import annotations

import argparse
import json
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
LOCAL = {"CP 3": [], "AFD 2:1, 1 micro-batch": ["--afd", "2:1", "--afd-micro-batches", "1"],
         "AFD 2:1, 2 micro-batches": ["--afd", "2:1", "--afd-micro-batches", "2"]}
TWO_HOSTS = {"CP 4": [], "AFD 2:2": ["--afd", "2:2"]}
MOE = {"model_type": "qwen3_moe", "hidden_size": 576, "num_hidden_layers": 12,
       "intermediate_size": 1536, "moe_intermediate_size": 512, "num_experts": 16,
       "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "norm_topk_prob": True, "num_attention_heads": 9, "num_key_value_heads": 3,
       "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 100000.0,
       "max_position_embeddings": 32768, "tie_word_embeddings": True}


def write_moe(path: Path) -> str:
    """The random Qwen3-MoE (weights scaled as a trained model's norms keep activations
    finite), with the embedded model's tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_moe

    from spmd_cp.models.gguf import build_tokenizer, default_model_path

    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(MOE))
    params = {k: v for k, v in tree_flatten(model.parameters()) if not k.endswith("lm_head.weight")}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(MOE))
    _, meta = mx.load(default_model_path(), return_metadata=True)
    build_tokenizer(meta)._tokenizer.save_pretrained(str(path))
    return str(path)


def launch(ranks: int, doc: Path, tokens: int, flags: list[str], cluster: bool) -> dict:
    args = ["generate", "--prompt-file", str(doc), "--no-chat-template", "--max-tokens",
            str(tokens), "--ignore-eos", "--kv-dtype", "float32", "--json", *flags]
    run = bl.run_json(bl.spmd_cp_command(ranks, args, cluster), env=bl.bench_env(1),
                      timeout=1800)
    return {key: run.get(key) for key in (
        "prompt_tokens", "tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "model_bytes",
        "kv_cache_bytes", "comm_bytes", "token_ids", "afd", "_others")}


def rounds_of(models: dict, layouts: dict, rounds: int, run, what: str) -> dict:
    """{"model | layout": [each round's ``run(flags)``]}, the rounds interleaving every
    model and layout."""
    runs = {}
    for _ in range(rounds):
        for model, path in models.items():
            for name, flags in layouts.items():
                bl.log(f"{model}: {name} {what}")
                extra = ["--model", path] if path else []
                runs.setdefault(f"{model} | {name}", []).append(run(flags + extra))
    return runs


def measure(models: dict, layouts: dict, ranks: int, doc: Path, tokens: int,
            cluster: bool, rounds: int) -> dict:
    where = f"at N = {ranks}{' (two hosts)' if cluster else ''}"
    return rounds_of(models, layouts, rounds,
                     lambda flags: launch(ranks, doc, tokens, flags, cluster), where)


def summary_rows(runs: dict) -> list[list]:
    rows, firsts = [], {}
    for key, each in runs.items():
        model, layout = key.split(" | ")
        run = each[0]
        first = firsts.setdefault(model, run)
        med = lambda name: bl.median(r[name] for r in each)  # noqa: E731
        afd = run.get("afd")
        straggler = "-" if not afd else "; ".join(
            f"{side} rank {s['slowest_rank']} waits {s['wait_share']:.0%}"
            for side, s in afd["straggler"].items())
        rows.append([model, layout, bl.fmt(med("prefill_tok_s"), 1),
                     bl.fmt(med("decode_tok_s"), 1),
                     "-" if not afd else bl.fmt(afd["bytes_per_token_layer"] / 1e3, 1),
                     bl.fmt(max(run["model_bytes"]) / 2**20, 0),
                     bl.fmt(max(run["kv_cache_bytes"]) / 2**20, 1), straggler,
                     "yes" if all(r["token_ids"] == first["token_ids"] for r in each)
                     else "no"])
    return rows


BATCH = {"CP 3": [], "AFD 2:1, 1 micro-batch": ["--afd", "2:1", "--afd-micro-batches", "1"],
         "AFD 2:1, 2 micro-batches (ping-pong)": ["--afd", "2:1", "--afd-micro-batches", "2"]}
QUESTIONS = ["What is this?", "Who wrote it?", "Is it free?", "What may I change?",
             "May I sell it?", "What must I share?", "Name a duty.", "Name a right."]


def batch_run(jobs: Path, flags: list[str], out: Path) -> dict:
    """One ``spmd-cp batch`` run: its summary and every job's token ids."""
    command = bl.spmd_cp_command(3, ["batch", "--jobs", str(jobs), "--output", str(out),
                                     "--max-batch", "8", "--kv-dtype", "float32", "--json",
                                     "--overwrite", *flags])
    summary = bl.run_json(command, env=bl.bench_env(1), timeout=1800)
    tokens = {job["id"]: job["token_ids"] for job in map(json.loads, out.open())}
    return {"decode_tok_s": summary["decode_tok_s"], "batch_sizes": summary["batch_sizes"],
            "tokens": tokens}


def measure_batches(models: dict, doc: Path, scratch: Path, rounds: int) -> dict:
    """{"model | layout": [each round's batch run]}."""
    prefix = scratch / "prefix.txt"
    prefix.write_text(doc.read_text()[:2500])
    jobs = scratch / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": str(i), "prefix_file": str(prefix), "prompt": q,
                                        "max_tokens": 24, "ignore_eos": True}) + "\n"
                            for i, q in enumerate(QUESTIONS)))
    return rounds_of(models, BATCH, rounds,
                     lambda flags: batch_run(jobs, flags, scratch / "out.jsonl"), "(batch)")


def batch_rows(runs: dict) -> list[list]:
    rows, firsts = [], {}
    for key, each in runs.items():
        model, layout = key.split(" | ")
        first = firsts.setdefault(model, each[0])
        same = all(r["tokens"] == first["tokens"] for r in each)
        rows.append([model, layout, bl.fmt(bl.median(r["decode_tok_s"] for r in each), 1),
                     "yes" if same else "no"])
    return rows


BATCH_HEADER = ["model", "layout", "aggregate decode tok/s", "every job's tokens = CP 3's"]


HEADER = ["model", "layout", "prefill tok/s", "decode tok/s", "KB crossing / token and layer",
          "weights MiB a rank (max)", "KV MiB a rank (max)", "slowest rank of each side",
          "tokens = CP's"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=6000, help="document characters")
    parser.add_argument("--tokens", type=int, default=17, help="tokens generated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", default=None, help="the two-host cluster's link rate")
    args = parser.parse_args()
    command = bl.command_line("bench_afd.py", sys.argv[1:])
    with tempfile.TemporaryDirectory() as scratch:
        doc = Path(scratch) / "document.txt"
        doc.write_text((GPL if GPL.is_file() else FALLBACK).read_text()[:args.chars])
        models = {"SmolLM2-135M (dense)": None,
                  "Qwen3-MoE 16x2 (random)": write_moe(Path(scratch) / "moe")}
        local = measure(models, LOCAL, 3, doc, args.tokens, False, args.rounds)
        batches = measure_batches(models, doc, Path(scratch), args.rounds)
        two_hosts = None
        if args.rate:
            try:
                subprocess.run([str(CLUSTER), "up", "2", "--rate", args.rate, "--slots", "2"],
                               check=True, capture_output=True, text=True)
                two_hosts = measure(models, TWO_HOSTS, 4, doc, args.tokens, True, args.rounds)
            finally:
                subprocess.run([str(CLUSTER), "down"], capture_output=True)
    prompt = next(iter(local.values()))[0]["prompt_tokens"]
    text = bl.header("Attention-FFN disaggregation", command)
    text += (f"\nMedians of {args.rounds} interleaved round(s). {prompt}-token prompt, "
             f"{args.tokens} tokens generated (--ignore-eos), float32 "
             "cache. KB crossing / token and layer: bytes both ways between the sides, "
             "every rank, per token row the attention ranks sent into a layer. Weights: "
             "CP holds the embedded GGUF's packed blocks (its native decode step reads "
             "them), --afd their float32 form (MLX's step).\n")
    text += "\n### N = 3, one host (shared memory)\n\n" + bl.table(HEADER, summary_rows(local))
    if two_hosts:
        text += (f"\n\n### N = 4, two simulated hosts at {args.rate} (2 ranks a host)\n\n"
                 + bl.table(HEADER, summary_rows(two_hosts)))
    text += ("\n\n### Batched decode, N = 3: 8 jobs of 24 tokens after a shared prefix\n\n"
             + bl.table(BATCH_HEADER, batch_rows(batches)))
    print(text)
    bl.save("afd", {"command": command, "machine": bl.machine(), "local": local,
                    "two_hosts": two_hosts, "rate": args.rate, "batches": batches}, text)


if __name__ == "__main__":
    main()
