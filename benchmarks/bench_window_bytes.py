"""Bytes pass-KV sends for sliding-window layers, against a full ring's, on a
Gemma-3-shaped model (``--json``'s ``window_kv_bytes`` and ``window_kv_ring_bytes``).

    python benchmarks/bench_window_bytes.py --ranks 2 4 --prompt-tokens 8160

The model is a random gemma3_text with Gemma 3's attention shape (head_dim 256, one KV
head, a 1,024-token window on five of every six layers, the global layer's RoPE base
1e6) and a small hidden size, so that an 8K prompt prefills in seconds on a CPU: the
bytes depend on the KV heads, head_dim, window and positions only, not on the hidden
size. Each N runs ``spmd-cp generate --cp-algo pass-kv --max-tokens 1 --json`` once; the
bytes are a function of the positions, so one run of each is the figure (the prefill
time is printed beside it for context, not compared).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (RESULTS, SPMD_CP, bench_env, header, log, machine, mpi_cmd, run_json,
                      save, table)

PROMPTS = RESULTS / "prompts"
SHAPE = {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
         "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "vocab_size": 49152,
         "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
         "sliding_window": 1024, "sliding_window_pattern": 6, "num_hidden_layers": 6,
         "max_position_embeddings": 32768}


def write_model(path: Path, config: dict) -> Path:
    """A random gemma3_text model in MLX format with the embedded model's tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    from spmd_cp.models.gguf import build_tokenizer, default_model_path

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    params = {k: v for k, v in tree_flatten(model.parameters()) if k != "lm_head.weight"}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    _, meta = mx.load(default_model_path(), return_metadata=True)
    build_tokenizer(meta)._tokenizer.save_pretrained(str(path))
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompt-tokens", type=int, default=8160,
                        help="a prompt file of benchmarks/results/prompts/")
    parser.add_argument("--window", type=int, default=SHAPE["sliding_window"])
    parser.add_argument("--name", default="gemma3_window_bytes")
    args = parser.parse_args()
    command = "python benchmarks/bench_window_bytes.py " + " ".join(sys.argv[1:])
    prompt = PROMPTS / f"prompt_{args.prompt_tokens}.txt"
    config = {**SHAPE, "sliding_window": args.window}
    local_layers = sum((i + 1) % config["sliding_window_pattern"] != 0
                       for i in range(config["num_hidden_layers"]))
    started = time.strftime("%Y-%m-%d %H:%M")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        model = write_model(Path(scratch) / "gemma3", config)
        for ranks in args.ranks:
            log(f"N={ranks}")
            result = run_json(mpi_cmd(ranks, SPMD_CP, "generate", "--model", model,
                                      "--prompt-file", prompt, "--no-chat-template",
                                      "--max-tokens", "1", "--cp-algo", "pass-kv", "--json"),
                              env=bench_env(1))
            sent, ring = sum(result["window_kv_bytes"]), sum(result["window_kv_ring_bytes"])
            runs.append({"ranks": ranks, "prompt_tokens": result["prompt_tokens"],
                         "window_kv_bytes": result["window_kv_bytes"],
                         "window_kv_ring_bytes": result["window_kv_ring_bytes"],
                         "comm_bytes": result["comm_bytes"], "ratio": sent / ring,
                         "ttft_s": result["ttft_s"], "load": result["_load"],
                         "others": result["_others"]})
    rows = [[r["ranks"], r["prompt_tokens"], -(-r["prompt_tokens"] // r["ranks"]),
             f"{sum(r['window_kv_bytes']) / 2**20:.1f}",
             f"{sum(r['window_kv_ring_bytes']) / 2**20:.1f}", f"{r['ratio']:.3f}",
             f"{sum(r['comm_bytes']) / 2**20:.1f}", f"{r['ttft_s']:.1f}", r["others"]]
            for r in runs]
    markdown = "\n".join([
        header("pass-KV bytes of sliding-window layers against a full ring", command), "",
        f"started {started}; model: random gemma3_text, {config['num_hidden_layers']} "
        f"layers ({local_layers} with a {args.window}-token window), "
        f"{config['num_key_value_heads']} KV head of {config['head_dim']}, float32 KV; "
        f"prompt {prompt.name} without a chat template; `--cp-algo pass-kv --max-tokens 1`",
        "",
        table(["ranks", "prompt tokens", "shard tokens", "window layers sent MiB",
               "full ring MiB", "sent / ring", "all comm MiB", "TTFT s (context only)",
               "others' cores"], rows)])
    print(markdown)
    save(args.name, {"command": command, "started": started, "machine": machine(),
                     "config": config, "runs": runs}, markdown)


if __name__ == "__main__":
    main()
