"""The GPU path measured in one short run: spmd-cp against mlx-lm on one GPU.

    python benchmarks/gpu_check.py --out results/gpu            # 1B-shape models, 8K and 32K
    python benchmarks/gpu_check.py --shape tiny --sizes 256 --exact-tokens 128 --out /tmp/g

Made for a GPU machine that is lent for a few minutes (benchmarks/gpu/README.md shows how
to set one up), it also runs anywhere MLX runs (the test suite runs it on the CPU at tiny
sizes with --device gpu, so the flow cannot rot while no GPU is at hand).

1. Models: a random-weight Llama of the given shape in bfloat16, and a 4-bit copy of it
   (mlx-lm's quantize_model, group size 64), in MLX format with --tokenizer's files.
2. Speed, for each prompt size (random English-like text cut to that many tokens, no chat
   template, --max-tokens greedy tokens):
   - mlx-lm: a fresh process loads the model with mlx_lm.load, warms up with one short
     generation (as spmd-cp warms up before timing), then times ``generate_step`` (its
     default prefill step of 2048 tokens): prefill tok/s, decode tok/s after the first
     token, peak memory (mx.get_peak_memory after the warm-up's reset);
   - ``mpiexec -n N spmd-cp generate --model M --prompt-file F --json --no-chat-template``
     for N = 1 and 2 (both ranks on the same GPU): the same figures from its ``--json``,
     and beside them the memory forecast's MLX arrays (what spmd-cp refuses a prompt by).
3. Exactness, for the bf16 and the 4-bit model, on a document of --exact-tokens tokens:
   ``spmd-cp score`` at N = 1 and at N = 2 for every --cp-algo, compared position by
   position (max |dlogprob|, argmax agreement), and N = 1 against mlx-lm's forward;
   each also against mlx-lm's forward of the same weights in float32, beside mlx-lm's
   own distance from it (the scale of the model dtype's rounding).
4. With --remedies, the runs that test the remedies the first H100 run pointed at, each
   with flags spmd-cp already has (*_REMEDIES): the rings with their partials in float32
   tiles (``--attention-kernel tiled``: one rounding to the model's dtype, after the
   merge, where the fused kernel's partials are rounded before it too), scored for
   exactness and timed at N = 2 for what that costs, and N = 1 with the whole prompt in
   one chunk (``--prefill-chunk 0``: what the first H100 run measured at 2.7-3.0x
   mlx-lm's memory, beside the default's 2,048-token chunks, mlx-lm's step). They run
   right after the runs they are compared with.

5. Where one rank's decode step spends its time, at each prompt size: benchmarks/
   decode_probe.py (the host building the step's graph, then MLX evaluating it), spmd-cp
   beside mlx-lm in one process.

Scores take the whole document in one chunk (``--prefill-chunk 0``), as mlx-lm's forward
does; the speed step's greedy tokens check the default's chunks against mlx-lm's.

Every step logs as it goes and rewrites OUT/gpu_check.json and OUT/gpu_check.md, so a run
stopped at any point leaves what it measured. Runs that fail are recorded with their
stderr's tail and the check goes on. A step that would start after --deadline seconds is
skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402
from bench_vs_mlx_lm import make_prompt  # noqa: E402

ALGOS = ("pass-kv", "pass-q", "allgather-kv")
SHAPES = {
    # Llama 3.2 1B's layer shapes (16 layers, 2048 wide, 32 query / 8 KV heads of 64).
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    # The GPU path's arithmetic on a CPU at a size it prefills 4K tokens of in seconds.
    "small": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    # For the CPU test of this script: the flow at a size that runs in seconds.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
# Remedies (--remedies): run name -> extra flags, beside the runs they remedy.
SPEED_REMEDIES = {"spmd-cp N=1 --prefill-chunk 0": (1, ["--prefill-chunk", "0"]),
                  "spmd-cp N=2 --attention-kernel tiled": (2, ["--attention-kernel", "tiled"])}
EXACT_REMEDIES = {f"{algo} tiled": (algo, ["--attention-kernel", "tiled"])
                  for algo in ("pass-kv", "pass-q")}


# -- models ---------------------------------------------------------------------------
def write_models(root: Path, shape: str, tokenizer_dir: Path | None) -> dict[str, str]:
    """bf16 and 4-bit random-weight Llama models in MLX format."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model

    config = dict(model_type="llama", vocab_size=49152, rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=131072,
                  tie_word_embeddings=True, **SHAPES[shape])
    tokenizer_files = tokenizer_files_from(tokenizer_dir, root / "tokenizer")
    paths = {}
    for name, bits in (("bf16", None), ("q4", 4)):
        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16)
        model_config = dict(config)
        if bits:
            model, model_config = quantize_model(model, model_config, group_size=64,
                                                 bits=bits)
        path = root / f"{shape}-{name}"
        path.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path / "model.safetensors"),
                            dict(tree_flatten(model.parameters())))
        (path / "config.json").write_text(json.dumps(model_config))
        for f in tokenizer_files.iterdir():
            shutil.copy(f, path / f.name)
        paths[name] = str(path)
        del model
    return paths


def tokenizer_files_from(tokenizer_dir: Path | None, scratch: Path) -> Path:
    """A folder of Hugging Face tokenizer files: --tokenizer's, or the embedded model's."""
    if tokenizer_dir is not None:
        return tokenizer_dir
    import mlx.core as mx

    from spmd_cp.models.gguf import build_tokenizer, default_model_path

    _, meta = mx.load(default_model_path(), return_metadata=True)
    scratch.mkdir(parents=True, exist_ok=True)
    build_tokenizer(meta)._tokenizer.save_pretrained(str(scratch))
    return scratch


# -- the mlx-lm child -------------------------------------------------------------------
def mlx_lm_child(args):
    """One fresh process: mlx-lm's own loader and generation loop, warmed up first."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(args.model)
    sampler = make_sampler(0.0)
    for _ in generate_step(mx.array(tokenizer.encode("Warm up the kernels.")), model,
                           max_tokens=2, sampler=sampler):
        pass
    if args.score_file:
        print(json.dumps(mlx_lm_scores(model, tokenizer, args.score_file)))
        return
    ids = tokenizer.encode(Path(args.prompt_file).read_text(encoding="utf-8"))
    mx.synchronize()
    mx.reset_peak_memory()
    tokens, stamps = [], []
    start = time.perf_counter()
    for token, _ in generate_step(mx.array(ids), model, max_tokens=args.max_tokens,
                                  sampler=sampler):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    ttft, decode_s = stamps[0] - start, stamps[-1] - stamps[0]
    print(json.dumps({
        "prompt_tokens": len(ids), "tokens": len(tokens), "token_ids": tokens,
        "ttft_s": ttft, "prefill_tok_s": len(ids) / ttft,
        "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else 0.0,
        "peak_mem_bytes": [int(mx.get_peak_memory())], "device": str(mx.default_device())}))


def mlx_lm_scores(model, tokenizer, path: str) -> dict:
    """Log-probability and argmax of every next token under mlx-lm's forward, of the ids
    mlx-lm's tokenizer gives (``compare`` refuses runs whose tokens differ); then the
    same forward in float32 (``float32``: the same weights, every product float32), the
    reference that shows how far the model's own dtype moves the scores at all."""
    import mlx.core as mx

    ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"))
    target = mx.array(ids[1:])

    def scores() -> dict:
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs[:-1], target[:, None], axis=-1)[:, 0]
        return {"token": ids[1:], "logprob": picked.tolist(),
                "argmax": mx.argmax(logprobs[:-1], axis=-1).tolist()}

    own = scores()
    model.set_dtype(mx.float32)  # a quantized model's packed weights stay as they are
    return {**own, "float32": scores()}


# -- the runs ---------------------------------------------------------------------------
def recorded_command(argv: list[str]) -> str:
    """The command as the result file records it: ``--out`` as the folder's name (where it
    was on the machine that ran it is nobody else's path)."""
    kept = [Path(arg).name if previous == "--out" else arg
            for previous, arg in zip([None, *argv], argv)]
    return "python benchmarks/gpu_check.py " + shlex.join(kept)


class Check:
    """The state of one check run: results so far, written out after every step."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.perf_counter()
        self.data: dict = {"command": recorded_command(sys.argv[1:]),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "machine": machine(), "speed": [], "exactness": [],
                           "skipped": [], "failures": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def in_time(self, what: str) -> bool:
        if self.elapsed() < self.args.deadline:
            return True
        self.data["skipped"].append(what)
        bl.log(f"skipped (past --deadline {self.args.deadline} s): {what}")
        return False

    def run(self, what: str, cmd: list, env: dict | None = None) -> dict | None:
        """One process; its JSON, or None with the failure recorded."""
        bl.log(f"[{self.elapsed():5.0f} s] {what}")
        try:
            result = bl.run_json([str(c) for c in cmd], env={**os.environ, **(env or {})},
                                 timeout=self.args.run_timeout, check=False, quiet_wait=0,
                                 sample_memory=False)
        except RuntimeError as error:  # past --run-timeout
            return self.failed(what, str(error))
        if result["_returncode"] != 0 or all(k.startswith("_") for k in result):
            return self.failed(what, f"exit {result['_returncode']}: {result.get('_stderr', '')}")
        return result

    def failed(self, what: str, error: str) -> None:
        self.data["failures"].append({"what": what, "error": error[-2000:]})
        bl.log(f"FAILED: {what}: {error[-800:]}")
        self.save()
        return None

    def save(self):
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.out / "gpu_check.json")
        tmp = self.out / "gpu_check.md.tmp"
        tmp.write_text(markdown(self.data))
        os.replace(tmp, self.out / "gpu_check.md")


def spmd_cp(device: str, ranks: int, *args) -> list:
    return bl.mpi_cmd(ranks, bl.SPMD_CP, *args, "--keep-quantized", "--device", device)


def speed(check: Check, models: dict, size: int, prompt: Path):
    """mlx-lm, spmd-cp N = 1 and N = 2 on one prompt of the bf16 model."""
    args = check.args
    model = models["bf16"]
    runs = {"mlx-lm": [sys.executable, __file__, "--mlx-lm-child", "--model", model,
                       "--prompt-file", prompt, "--max-tokens", args.max_tokens]}
    variants = []
    for n in (1, 2):  # each run, then its remedies
        variants.append((f"spmd-cp N={n}", n, []))
        if args.remedies:
            variants += [(name, m, flags) for name, (m, flags) in SPEED_REMEDIES.items()
                         if m == n]
    for name, n, flags in variants:
        runs[name] = spmd_cp(args.device, n, "generate", "--model", model, "--prompt-file",
                             prompt, "--json", "--no-chat-template", "--max-tokens",
                             args.max_tokens, *flags)
    row = {"size": size, "model": "bf16", "planned": list(runs)}
    for name, cmd in runs.items():
        if not check.in_time(f"speed {size} {name}"):
            continue
        r = check.run(f"speed {size} tokens: {name}", cmd)
        if r is None:
            continue
        row[name] = {k: r.get(k) for k in ("prompt_tokens", "ttft_s", "prefill_tok_s",
                                            "decode_tok_s", "peak_mem_bytes", "warmup_s",
                                            "token_ids", "kv_dtype", "algo", "decode_step",
                                            "compute_path", "device", "memory_forecast",
                                            "_wall_s")}
        bl.log(f"  prefill {r.get('prefill_tok_s', 0):.0f} tok/s, decode "
               f"{r.get('decode_tok_s', 0):.1f} tok/s, peak "
               + "/".join(f"{b / 2**30:.2f}" for b in r.get("peak_mem_bytes") or []) + " GiB")
        check.data["speed"] = [x for x in check.data["speed"] if x["size"] != size] + [row]
        check.save()


def read_scores(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {k: [r[k] for r in records] for k in ("token", "logprob", "argmax")}


def compare(a: dict, b: dict) -> dict:
    """max |dlogprob| and argmax agreement of two score runs of the same tokens."""
    import numpy as np

    if a["token"] != b["token"]:
        return {"error": "different tokens"}
    da = np.abs(np.array(a["logprob"]) - np.array(b["logprob"]))
    agree = float(np.mean(np.array(a["argmax"]) == np.array(b["argmax"])))
    return {"max_dlogprob": float(da.max()), "mean_dlogprob": float(da.mean()),
            "argmax_agreement": agree, "positions": len(a["token"])}


def exactness(check: Check, models: dict, document: Path):
    """Every --cp-algo at N = 2 against N = 1, and N = 1 against mlx-lm, per model."""
    work = check.out / "scores"
    work.mkdir(exist_ok=True)
    runs = [(1, "auto", "auto", [])]
    for algo in ALGOS:  # each algorithm, then its remedies
        runs.append((2, algo, algo, []))
        if check.args.remedies:
            runs += [(2, run, a, flags) for run, (a, flags) in EXACT_REMEDIES.items()
                     if a == algo]
    for name, model in models.items():
        scores = {}
        for n, run, algo, flags in runs:
            what = f"score {name} N={n} --cp-algo {algo} {' '.join(flags)}".strip()
            if not check.in_time(what):
                continue
            out = work / f"{name}_n{n}_{run.replace(' ', '_')}.jsonl"
            r = check.run(what, spmd_cp(check.args.device, n, "score", "--model", model,
                                        "--text-file", document, "--output", out,
                                        "--overwrite", "--cp-algo", algo, "--json",
                                        "--prefill-chunk", "0", *flags))
            if r is not None:
                scores[(n, run)] = read_scores(out)
        reference, r = None, None
        if check.in_time(f"mlx-lm scores {name}"):
            r = check.run(f"mlx-lm scores {name}",
                          [sys.executable, __file__, "--mlx-lm-child", "--model", model,
                           "--score-file", document])
        if r is not None:
            reference = {k: r[k] for k in ("token", "logprob", "argmax")}
        full = r.get("float32") if r is not None else None
        base = scores.get((1, "auto"))

        def record(run: str, this: dict, other: dict):
            entry = {"model": name, "run": run, **compare(this, other)}
            if full is not None:
                entry["vs_float32"] = compare(this, full)
            check.data["exactness"].append(entry)

        if reference is not None and full is not None:
            check.data["exactness"].append({"model": name, "run": "mlx-lm vs float32",
                                            **compare(reference, full)})
        if base is not None and reference is not None:
            record("N=1 vs mlx-lm", base, reference)
        for n, run, _, _ in runs[1:]:
            if base is not None and (n, run) in scores:
                record(f"N=2 {run} vs N=1", scores[(n, run)], base)
        for e in check.data["exactness"]:
            if e["model"] == name:
                bl.log(f"  {name} {e['run']}: max |dlogprob| {e.get('max_dlogprob')}, "
                       f"argmax agreement {e.get('argmax_agreement')}")
        check.save()


PROBE = Path(__file__).resolve().parent / "decode_probe.py"


def decode_probe(check: Check, model: str, sizes: list[int]):
    """benchmarks/decode_probe.py at every prompt size, in one process."""
    what = "decode probe " + " ".join(map(str, sizes))
    if not check.in_time(what):
        return
    r = check.run(what, bl.mpi_cmd(1, sys.executable, PROBE, "--model", model,
                                   "--contexts", *sizes, "--device", check.args.device))
    if r is not None:
        check.data["decode_probe"] = r["decode_probe"]
        for row in r["decode_probe"]:
            bl.log(f"  {row['context']}: " + ", ".join(
                f"{name} build {row[name]['build_ms']:.2f} / eval {row[name]['eval_ms']:.2f} ms"
                for name in ("mlx-lm", "spmd-cp")))
        check.save()


# -- output -----------------------------------------------------------------------------
def machine() -> dict:
    import importlib.metadata as md
    import subprocess

    info = bl.machine()
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    for name in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cpu", "mlx-metal"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return info


EXACTNESS_NOTE = (
    "\"vs float32\": each run's distance from the same weights evaluated in float32 "
    "(mlx-lm's forward after `set_dtype(float32)`); \"mlx-lm vs float32\" is how far the "
    "model's own dtype moves the scores. A run that merges partials is as exact as the "
    "model's dtype allows when it is no further from float32 than mlx-lm is (the CPU "
    "suite's bar: 1.5 times that + 2e-3); against N = 1 alone, any change in where "
    "bfloat16 rounds shows.")


def forecast_arrays(forecast: dict | None) -> int:
    """The forecast's MLX arrays (what ``peak_mem_bytes`` counts): weights, KV and
    activations, without the process's other resident bytes (0: no forecast)."""
    if not forecast:
        return 0
    return sum(forecast.get(k, 0) for k in ("weights_bytes", "kv_bytes", "activations_bytes"))


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = ["# GPU check: spmd-cp against mlx-lm\n",
             f"Machine: {m.get('gpu') or 'no NVIDIA GPU'}; {m['cpu']}, {m['cores']} cores; "
             f"mlx {m.get('mlx')}, mlx-lm {m.get('mlx-lm')}"
             + "".join(f", {k} {m[k]}" for k in ("mlx-cuda-13", "mlx-cuda-12") if k in m)
             + f". Date: {data['date']}. Command: `{data['command']}`.\n"]
    rows = []
    for row in data["speed"]:
        ref = row.get("mlx-lm")
        for name in row.get("planned", ["mlx-lm", "spmd-cp N=1", "spmd-cp N=2"]):
            r = row.get(name)
            if r is None:
                rows.append([row["size"], name, "failed or skipped", "", "", "", "", "", ""])
                continue
            peak = max(r["peak_mem_bytes"] or [0])
            forecast = forecast_arrays(r.get("memory_forecast"))

            def ratio(key, value):
                return bl.fmt(value / ref[key]) if ref and ref.get(key) else "-"
            rows.append([r["prompt_tokens"], name, f"{r['prefill_tok_s']:.0f}",
                         ratio("prefill_tok_s", r["prefill_tok_s"]),
                         f"{r['decode_tok_s']:.1f}", ratio("decode_tok_s", r["decode_tok_s"]),
                         f"{peak / 2**30:.2f}",
                         bl.fmt(peak / max(ref["peak_mem_bytes"])) if ref else "-",
                         f"{forecast / 2**30:.2f}" if forecast else "-"])
    lines.append("## Speed and memory (bf16 model)\n")
    lines.append(bl.table(["prompt tokens", "run", "prefill tok/s", "x mlx-lm", "decode tok/s",
                           "x mlx-lm", "peak GiB (largest rank)", "x mlx-lm",
                           "forecast GiB (MLX arrays)"], rows))
    lines.append("\n## Exactness\n")
    lines.append(bl.table(["model", "compared", "max |dlogprob|", "mean |dlogprob|",
                           "argmax agreement", "positions", "max |dlogprob| vs float32"],
                          [[e["model"], e["run"], bl.fmt(e.get("max_dlogprob"), 5),
                            bl.fmt(e.get("mean_dlogprob"), 6),
                            bl.fmt(e.get("argmax_agreement"), 4), e.get("positions"),
                            bl.fmt((e.get("vs_float32") or {}).get("max_dlogprob"), 5)]
                           for e in data["exactness"]]))
    lines.append("\n" + EXACTNESS_NOTE)
    if data.get("decode_probe"):
        lines.append("\n## One rank's decode step (benchmarks/decode_probe.py)\n")
        lines.append(bl.table(
            ["context", "run", "build ms", "eval ms", "build + eval ms"],
            [[row["context"], name, bl.fmt(row[name]["build_ms"]),
              bl.fmt(row[name]["eval_ms"]), bl.fmt(row[name]["step_ms"])]
             for row in data["decode_probe"] for name in ("mlx-lm", "spmd-cp")]))
    if data["skipped"] or data["failures"]:
        lines.append("\n## Not measured\n")
        lines += [f"- skipped: {s}" for s in data["skipped"]]
        lines += [f"- failed: {f['what']}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for gpu_check.json/.md and work (required)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--exact-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--exact-models", nargs="+", choices=["bf16", "q4"],
                        default=["bf16", "q4"], help="models whose scores are compared")
    parser.add_argument("--remedies", action="store_true",
                        help="also the runs that test the remedies (*_REMEDIES above)")
    parser.add_argument("--tokenizer", type=Path,
                        help="Hugging Face tokenizer files (default: the embedded model's)")
    parser.add_argument("--deadline", type=float, default=360,
                        help="start no step after this many seconds")
    parser.add_argument("--run-timeout", type=float, default=150, help="per process, s")
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                        help="spmd-cp's --device (gpu: the GPU path, on a CPU too)")
    parser.add_argument("--mlx-lm-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    parser.add_argument("--score-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mlx_lm_child:
        mlx_lm_child(args)
        return
    if not args.out:
        parser.error("--out is required")
    check = Check(args)
    bl.log(f"machine: {check.data['machine'].get('gpu')}, mlx {check.data['machine'].get('mlx')}")
    models = write_models(check.out / "models", args.shape, args.tokenizer)
    bl.log(f"[{check.elapsed():5.0f} s] models written: {models}")
    import mlx_lm

    _, tokenizer = mlx_lm.load(models["bf16"])
    prompts = {}
    for size in sorted(set(args.sizes + [args.exact_tokens])):
        text, _ = make_prompt(tokenizer, size, seed=size)
        prompts[size] = check.out / f"prompt_{size}.txt"
        prompts[size].write_text(text)
    sizes = sorted(args.sizes)
    # The most said in the least time, should the machine be taken back: the smallest size,
    # the bf16 model's exactness, the decode probe, the other sizes, then the 4-bit
    # model's exactness.
    speed(check, models, sizes[0], prompts[sizes[0]])
    if "bf16" in args.exact_models:
        exactness(check, {"bf16": models["bf16"]}, prompts[args.exact_tokens])
    decode_probe(check, models["bf16"], sizes)
    for size in sizes[1:]:
        speed(check, models, size, prompts[size])
    if "q4" in args.exact_models:
        exactness(check, {"q4": models["q4"]}, prompts[args.exact_tokens])
    check.save()
    print(markdown(check.data))


if __name__ == "__main__":
    main()
