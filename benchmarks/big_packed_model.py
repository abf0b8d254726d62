"""A model of Llama-3.1-8B's shapes in llama.cpp's `Q4_K_M` layout, random weights: does
`generate` run at N = 2 on this machine, and what does a rank hold?

    python benchmarks/big_packed_model.py [--ranks 2] [--tokens 16] [--keep FILE.gguf]

The file (about 4.7 GB) is written with the gguf package (llama.cpp's own writer) into
a scratch folder, or kept at --keep (then reused when it exists): Llama-3.1-8B's 32
layers of hidden 4096, feed-forward 14336, 32 heads of 128 and 8 key/value heads, its
128,256-token vocabulary with a separate head; the types llama.cpp's `Q4_K_M` gives
them (Q4_K; Q6_K for the head and for attn_v and ffn_down in the layers where
llama.cpp's "more bits" rule puts them), float32 norms. Random block bytes with sane
float16 scales (tests/gguf_files.py), and the embedded SmolLM2's byte-level BPE
tokenizer, its vocabulary padded with reserved tokens to 128,256 as Llama 3's is.

Then `OPENBLAS_NUM_THREADS=1 mpiexec -n N spmd-cp generate --model FILE --prompt ...
--no-chat-template --max-tokens T --json` and, where llama-cpp-python is importable, the
same file, prompt and tokens in llama.cpp on N threads (a 1,024-token context): prefill
and decode tok/s, each rank's resident peak against the bound 1.5 x the file's bytes +
0.5 GB, and llama.cpp's whole process. Random weights make the text meaningless; the
figures are what count. Result: benchmarks/results/big_packed_model.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import benchlib as bl  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
CONTEXT = 1024  # llama.cpp's context: the prompt and the answer fit
PROMPT = ("The quarterly report lists the shipments of every warehouse in the northern "
          "region, the delays each one saw, and what the managers plan to change before "
          "the winter season begins. ") * 4


def more_bits(layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third
    one between (attn_v and ffn_down get Q6_K there in `Q4_K_M`)."""
    eighth = LAYERS // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def write_model(path: Path):
    from gguf_files import random_tensor, tokenizer_metadata, write_gguf

    rng = np.random.RandomState(0)
    meta = {"llama.context_length": 131072, "llama.embedding_length": HIDDEN,
            "llama.block_count": LAYERS, "llama.feed_forward_length": FFN,
            "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
            "llama.rope.dimension_count": HEAD_DIM,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 500000.0}
    tokenizer = tokenizer_metadata()
    pad = VOCAB - len(tokenizer["tokenizer.ggml.tokens"])
    tokenizer["tokenizer.ggml.tokens"] = list(tokenizer["tokenizer.ggml.tokens"]) + \
        [f"<|reserved_special_token_{i}|>" for i in range(pad)]
    tokenizer["tokenizer.ggml.token_type"] = \
        list(tokenizer["tokenizer.ggml.token_type"]) + [3] * pad  # control tokens
    meta.update(tokenizer)
    shapes = {"token_embd": ((VOCAB, HIDDEN), "Q4_K"), "output": ((VOCAB, HIDDEN), "Q6_K")}
    for i in range(LAYERS):
        wide = "Q6_K" if more_bits(i) else "Q4_K"
        shapes.update({f"blk.{i}.attn_q": ((HIDDEN, HIDDEN), "Q4_K"),
                       f"blk.{i}.attn_k": ((KV_HEADS * HEAD_DIM, HIDDEN), "Q4_K"),
                       f"blk.{i}.attn_v": ((KV_HEADS * HEAD_DIM, HIDDEN), wide),
                       f"blk.{i}.attn_output": ((HIDDEN, HIDDEN), "Q4_K"),
                       f"blk.{i}.ffn_gate": ((FFN, HIDDEN), "Q4_K"),
                       f"blk.{i}.ffn_up": ((FFN, HIDDEN), "Q4_K"),
                       f"blk.{i}.ffn_down": ((HIDDEN, FFN), wide)})
    tensors = {f"{name}.weight": (random_tensor(kind, shape, rng), kind)
               for name, (shape, kind) in shapes.items()}
    for name in ["output_norm"] + [f"blk.{i}.{n}" for i in range(LAYERS)
                                   for n in ("attn_norm", "ffn_norm")]:
        tensors[f"{name}.weight"] = (rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), "F32")
    write_gguf(path, "llama", meta, tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--keep", default=None, help="write the file here (reused if it exists)")
    parser.add_argument("--llama-worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_worker:
        # a context of the prompt and answer: the model's 131,072 tokens would allocate
        # a 17 GB KV cache, as spmd-cp's cache grows with what it holds
        print(json.dumps(bl.llama_cpp_greedy(args.model, args.llama_worker, args.ranks,
                                             args.tokens, n_ctx=CONTEXT)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.keep) if args.keep else Path(scratch) / "llama-8b-shape-q4_k_m.gguf"
        if not model.is_file():
            bl.log(f"writing {model.name}")
            write_model(model)
        prompt = Path(scratch) / "prompt.txt"
        prompt.write_text(PROMPT)
        file_bytes = model.stat().st_size
        bound = 1.5 * file_bytes + 0.5e9
        runs = {}
        bl.log(f"spmd-cp at N = {args.ranks}")
        runs["spmd-cp"] = bl.run_json(bl.mpi_cmd(
            args.ranks, "spmd-cp", "generate", "--model", model, "--prompt-file", prompt,
            "--no-chat-template", "--max-tokens", args.tokens, "--json"),
            env=bl.bench_env(1), timeout=3600)
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            bl.log("llama-cpp-python is not installed: spmd-cp runs alone")
        else:
            bl.log(f"llama.cpp on {args.ranks} threads")
            runs["llama.cpp"] = bl.run_json(
                [sys.executable, __file__, "--llama-worker", str(prompt), "--model",
                 str(model), "--ranks", str(args.ranks), "--tokens", str(args.tokens)],
                env=bl.bench_env(args.ranks), timeout=3600)
    ours = runs["spmd-cp"]
    rows = [[f"spmd-cp, {args.ranks} ranks", bl.fmt(ours["prefill_tok_s"]),
             bl.fmt(ours["decode_tok_s"]),
             ", ".join(f"{b / 1e9:.2f}" for b in ours["resident_peak_bytes"]),
             ", ".join(f"{b / 1e9:.2f}" for b in ours["model_bytes"])]]
    if "llama.cpp" in runs:
        theirs = runs["llama.cpp"]
        rows.append([f"llama.cpp, {args.ranks} threads", bl.fmt(theirs["prefill_tok_s"]),
                     bl.fmt(theirs["decode_tok_s"]),
                     f"{max(theirs['_rss_peaks'], default=0) / 1e9:.2f} (whole process)", "-"])
    argv = [Path(a).name if a.endswith(".gguf") else a for a in sys.argv[1:]]
    command = bl.command_line("big_packed_model.py", argv)  # --keep's folder left out
    text = (bl.header("A model of Llama-3.1-8B's shapes, Q4_K_M, random weights", command)
            + f"\nfile: {file_bytes / 1e9:.2f} GB; bound a rank: 1.5 x file + 0.5 GB = "
            f"{bound / 1e9:.2f} GB; prompt {ours['prompt_tokens']} tokens, "
            f"{args.tokens} tokens generated\n\n"
            + bl.table(["run", "prefill tok/s", "decode tok/s", "resident peak (GB)",
                        "model_bytes (GB)"], rows)
            + f"\n\nwithin the bound: {max(ours['resident_peak_bytes']) <= bound}")
    print(text)
    bl.save("big_packed_model", {"machine": bl.machine(), "command": command,
                                 "file_bytes": file_bytes, "bound_bytes": bound,
                                 "runs": runs}, text)


if __name__ == "__main__":
    main()
