"""Where a native decode step's time goes, part by part, at N = 1 and N = 2.

    python benchmarks/decode_components.py                        # 3K and 6.5K, float16
    python benchmarks/decode_components.py --contexts 3000 --kv-dtype float32 --rounds 3

A component benchmark: it explains the step's time, it does not replace vs_llamacpp.py
(whole ``spmd-cp generate`` runs against llama.cpp). Each launch loads the embedded
SmolLM2-135M Q4_1 GGUF (its quantized shadows: decode reads the packed weights), builds
a synthetic KV cache of exactly the context (random keys and values at the head-tail
positions, as decode_worker.py does) in ``--kv-dtype``, and decodes greedy tokens with
generation.decode_tokens, the loop generate runs. The native step's own method is
swapped for a copy of it that reads a clock around every C call and every collective, so
each token's time splits into:

    qkv, attend, merge, output, mlp, head   the C calls (products, attention, merges)
    gather qkv, gather partials, sum o, sum mlp, gather logits
                                             the collectives, waits for the peer included
    layer python                             the layer loop's own Python (cache row,
                                             pointers, ctypes and mpi4py calls' entry)
    outside                                  what the loop around the step costs:
                                             sampling, the token's broadcast, positions

Each launch also times, with both ranks in step (a barrier first), a bare round of the
four per-layer collectives (their latency when neither waits for the other) and a bare
ctypes call, and every token once without the clocks (``plain``, against ``timed``: the
clocks' own cost). Launches: the variants alternate in every round (N = 2 with one
thread a rank, N = 1 with one and with two threads), contexts within each launch.
``--trees base=PATH this=.`` measures two checkouts side by side (spmd_cp imported from
each, its launches alternating with the other's in every round): an A/B of a change.
Reported: per variant and context the median over rounds of each part's median per
token, in ms, per rank. Results: benchmarks/results/<--name>.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

# (name, ranks, threads per rank)
VARIANTS = [("N=2, 1 thread each", 2, 1), ("N=1, 1 thread", 1, 1), ("N=1, 2 threads", 1, 2)]
PARTS = ["qkv", "gather qkv", "attend", "gather partials", "merge", "output", "sum o",
         "mlp", "sum mlp", "layer python", "head", "gather logits", "step python", "outside"]
COLLECTIVES = ["gather qkv", "gather partials", "sum o", "sum mlp", "gather logits"]


def synthetic_cache(comm, model, context: int):
    """A cache of ``context`` tokens at head-tail positions, random K/V in the model's
    KV dtype."""
    import mlx.core as mx

    from spmd_cp.attention.partition import head_tail_positions
    from spmd_cp.engine.cache.cache import ShardedKVCache

    positions = head_tail_positions(context, comm.size)
    attn = model.layers[0].self_attn
    shape = (model.num_kv_heads, positions[comm.rank].size,
             attn.o_proj.weight.shape[1] // model.num_heads)
    arrays = {f"layer.{i}.{part}": mx.random.normal(shape).astype(model.kv_dtype)
              for i in range(model.num_layers) for part in ("keys", "values")}
    mx.eval(list(arrays.values()))
    shared = {"num_tokens": context, "token_ids": [0] * context, "decode_steps": 0,
              "decode_owner": 0, "shard_sizes": [p.size for p in positions]}
    return ShardedKVCache.from_state(model.num_layers, comm.rank, positions, arrays, shared,
                                     model.kv_dtype)


class Clock:
    """Nanoseconds per part, summed over one token: wall time, and this thread's CPU
    time (on a shared machine the wall time includes the time the rank was not running;
    a collective's CPU time is MPI's polling)."""

    def __init__(self):
        self.parts, self.cpu = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0)
        self.last, self.last_cpu = time.perf_counter_ns(), time.thread_time_ns()

    def lap(self, part: str):
        now, cpu = time.perf_counter_ns(), time.thread_time_ns()
        self.parts[part] += now - self.last
        self.cpu[part] += cpu - self.last_cpu
        self.last, self.last_cpu = now, cpu


def run_collective(request, clock: Clock, part: str):
    request.Start()
    request.Wait()
    clock.lap(part)


def timed_layer(dec, clock: Clock, index: int, layer, layer_kv, store, rotation, scores,
                added):
    """One layer of NativeDecoder.step, each call clocked; returns ``added``."""
    lib, a, size = dec.library, dec._addresses, dec.comm.size
    split = dec.split is not None
    gather, *split_requests = dec.requests or [None]
    row = layer_kv.reserve_row(dec.kv_heads, dec.head_dim) if store else -1
    length = layer_kv.offset
    if length:
        dec._attach_cache(index, layer_kv)
    clock.lap("layer python")
    lib.spmd_cp_decode_qkv(layer, a.h, added, a.normed, a.qkv_local)
    clock.lap("qkv")
    if split:
        gather_qkv, sum_o, sum_mlp = split_requests
        run_collective(gather_qkv, clock, "gather qkv")
    lib.spmd_cp_decode_attend(layer, a.qkv, rotation, row, length, size == 1, scores,
                              a.partial if size > 1 else a.attention)
    clock.lap("attend")
    if size > 1:
        run_collective(gather, clock, "gather partials")
        lib.spmd_cp_decode_merge(size, dec.heads, dec.head_dim, dec.scale, a.partials,
                                 a.attention)
        clock.lap("merge")
    lib.spmd_cp_decode_output(layer, a.attention, a.o_part)
    clock.lap("output")
    if split:
        run_collective(sum_o, clock, "sum o")
    lib.spmd_cp_decode_mlp(layer, a.h, a.o_sum if split else a.o_part, a.mlp_scratch,
                           a.mlp_part)
    clock.lap("mlp")
    if split:
        run_collective(sum_mlp, clock, "sum mlp")
    return a.mlp_sum if split else a.mlp_part


def timed_step(dec, clocks: list, token: int, position: int, cache, store: bool,
               on_layer=None, tracer=None):
    """NativeDecoder.step with a clock around every call (the same calls, in order)."""
    import ctypes

    import mlx.core as mx
    import numpy as np

    clock = Clock()
    clocks.append(clock)
    np.copyto(dec.h, dec.embedding[token])
    rotations = dec._rotations(position)
    scores = dec._scores(cache.layers[0].offset + 1)
    clock.lap("step python")
    added = None
    for index, (layer, layer_kv) in enumerate(zip(dec._layer_refs, cache.layers)):
        added = timed_layer(dec, clock, index, layer, layer_kv, store, rotations[index],
                            scores, added)
    comm, a = dec.comm, dec._addresses
    comm.bytes_sent += len(dec.layers) * dec.sent
    if dec.split is None and comm.rank != 0:
        return None
    dec.library.spmd_cp_decode_head(ctypes.byref(dec.head), dec.dim, a.h, added, a.norm,
                                    dec.norm_eps, a.normed, a.logits)
    clock.lap("head")
    if dec.split is not None:
        comm.mpi.Gatherv(dec.logits, [dec.all_logits, dec.vocab_counts]
                         if comm.rank == 0 else None, root=0)
        clock.lap("gather logits")
        if comm.rank != 0:
            return None
    logits = mx.array(dec.all_logits)
    clock.lap("step python")
    return logits


def time_tokens(engine, cache, tokens: int, skip: int, clocks: list | None) -> list:
    """Seconds of each greedy token after the first ``skip`` (``clocks``: the step
    clocked into it, else plain); the cache rolled back after."""
    import mlx.core as mx

    from spmd_cp.engine.generation import decode_tokens

    comm, checkpoint, decoder = engine.comm, cache.checkpoint(), engine.decoder
    first = len(clocks) if clocks is not None else 0
    if clocks is not None:
        decoder.step = functools.partial(timed_step, decoder, clocks)
    steps = decode_tokens(engine, cache, mx.array([0.0, 1.0]), mx.argmax, tokens + 1)
    next(steps)  # sampled from the stand-in logits: no step yet
    seconds = []
    try:
        for step in range(tokens):
            comm.barrier()
            start = time.perf_counter()
            next(steps)
            if step >= skip:
                seconds.append(time.perf_counter() - start)
        if clocks is not None:
            del clocks[first:first + skip]
    finally:
        decoder.__dict__.pop("step", None)
        cache.rollback(checkpoint)
    return seconds


def bare_costs(engine, repeats: int = 2000) -> dict:
    """Microseconds of a ctypes call into the library and, both ranks in step, of one
    round of the four per-layer collectives and of the logits' Gatherv."""
    decoder, comm = engine.decoder, engine.comm
    lib = decoder.library
    start = time.perf_counter()
    for _ in range(repeats):
        lib.spmd_cp_decode_scratch(9, 64, 100)
    out = {"ctypes_call_us": 1e6 * (time.perf_counter() - start) / repeats}
    if comm.size > 1:
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            for request in decoder.requests:
                request.Start()
                request.Wait()
        out["four_collectives_us"] = 1e6 * (time.perf_counter() - start) / repeats
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeats // 4):
            comm.mpi.Gatherv(decoder.logits, [decoder.all_logits, decoder.vocab_counts]
                             if comm.rank == 0 else None, root=0)
        out["gather_logits_us"] = 1e6 * (time.perf_counter() - start) / (repeats // 4)
    return out


def measure_context(engine, cache, args) -> dict:
    """Plain and clocked tokens alternating for ``args.inner`` blocks: medians in ms."""
    import numpy as np

    plain, timed, clocks = [], [], []
    for _ in range(args.inner):
        plain += time_tokens(engine, cache, args.tokens, args.skip, None)
        timed += time_tokens(engine, cache, args.tokens, args.skip, clocks)
    parts, cpu = {}, {}
    for part in PARTS[:-1]:
        parts[part] = 1e3 * float(np.median([1e-9 * c.parts[part] for c in clocks]))
        cpu[part] = 1e3 * float(np.median([1e-9 * c.cpu[part] for c in clocks]))
    inside = [1e-9 * sum(c.parts.values()) for c in clocks]
    parts["outside"] = 1e3 * float(np.median(np.array(timed) - np.array(inside)))
    return {"plain_ms": 1e3 * float(np.median(plain)), "timed_ms": 1e3 * float(np.median(timed)),
            "parts_ms": parts, "parts_cpu_ms": cpu, **bare_costs(engine)}


def worker(args):
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    from spmd_cp.config import DecodeConfig
    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.model import CPModel
    from spmd_cp.models.loader import default_model_path, load_model
    from spmd_cp.runtime import spmd

    def main(comm, _options):
        loaded = load_model(default_model_path())
        model = CPModel(loaded.model, cpu_kv_dtype=args.kv_dtype)
        engine = Engine(model, comm, decode=DecodeConfig(decode_tp="on" if comm.size > 1
                                                         else "auto"))
        plan = engine.prepare_decode()
        if plan.step != "native":
            raise RuntimeError(f"the native step does not run here: {plan.describe()}")
        results = {}
        for context in args.contexts:
            cache = synthetic_cache(comm, model, context)
            results[context] = measure_context(engine, cache, args)
            del cache
        gathered = comm.gather_object(results)
        if comm.rank == 0:
            print(json.dumps({"ranks": comm.size, "plan": plan.describe(),
                              "per_rank": gathered}))

    sys.exit(spmd.run_main(main, {}))


def trees(args) -> list[tuple[str, str]]:
    """(label, path) of each source tree measured: ``--trees``, else this one."""
    pairs = [tree.split("=", 1) for tree in args.trees] or [["this", str(bl.ROOT)]]
    return [(label, str(Path(path).resolve())) for label, path in pairs]


def columns(args) -> list[tuple[str, int, int, str]]:
    """(name, ranks, threads, tree path) of each variant measured, per tree."""
    labelled = len(trees(args)) > 1
    return [(f"{name} [{label}]" if labelled else name, ranks, threads, path)
            for index in args.variants for name, ranks, threads in [VARIANTS[index]]
            for label, path in trees(args)]


def launch(column: tuple, args) -> dict:
    """One launch of the worker: spmd_cp imported from the column's tree."""
    name, ranks, threads, path = column
    cmd = bl.mpi_cmd(ranks, bl.PYTHON, __file__, "--worker", "--contexts", *args.contexts,
                     "--kv-dtype", args.kv_dtype, "--tokens", args.tokens, "--skip",
                     args.skip, "--inner", args.inner)
    result = bl.run_json(cmd, env=bl.bench_env(threads, PYTHONPATH=path))
    result["_variant"], result["_tree"] = name, bl.from_root(path)
    for context in args.contexts:
        steps = [r[str(context)]["plain_ms"] for r in result["per_rank"]]
        bl.log(f"{name}, {context} tokens: step {max(steps):.2f} ms (others "
               f"{result['_others']:.2f} cores)")
    return result


def medians(runs: list[dict], context: int, key) -> list:
    """Per rank, the median over runs of key(that rank's result at ``context``)."""
    ranks = len(runs[0]["per_rank"])
    return [bl.median([key(run["per_rank"][r][str(context)]) for run in runs])
            for r in range(ranks)]


def report(runs: list[dict], args, command: str) -> str:
    lines = [bl.header("Decode step components (native step, quantized shadows)", command),
             f"KV cache {args.kv_dtype}; {args.rounds} rounds, each launch {args.inner} "
             f"blocks of {args.tokens} tokens ({args.skip} skipped) clocked and as many "
             "not; ms per token, median; one column per rank; a part's cell: wall / this "
             "thread's CPU time (on a shared machine the wall time includes time the rank "
             "waited for a core).\n"]
    for context in args.contexts:
        header, rows = ["part"], {part: [part] for part in PARTS}
        totals = {k: [k] for k in ("sum of parts", "timed token", "plain token",
                                   "bare 4 collectives x layers", "bare ctypes call (us)")}
        for name, ranks, _, _ in columns(args):
            mine = [r for r in runs if r["_variant"] == name]
            if not mine:
                continue
            header += [f"{name} r{r}" for r in range(ranks)]
            for part in PARTS:
                wall = medians(mine, context, lambda c, p=part: c["parts_ms"][p])
                cpu = medians(mine, context, lambda c, p=part: c["parts_cpu_ms"].get(p))
                rows[part] += [f"{bl.fmt(w, 2)} / {bl.fmt(c, 2)}" for w, c in zip(wall, cpu)]
            totals["sum of parts"] += [bl.fmt(v, 2) for v in medians(
                mine, context, lambda c: sum(c["parts_ms"].values()))]
            totals["timed token"] += [bl.fmt(v, 2) for v in
                                      medians(mine, context, lambda c: c["timed_ms"])]
            totals["plain token"] += [bl.fmt(v, 2) for v in
                                      medians(mine, context, lambda c: c["plain_ms"])]
            totals["bare 4 collectives x layers"] += [bl.fmt(v, 2) for v in medians(
                mine, context, lambda c: 30e-3 * c.get("four_collectives_us", float("nan")))]
            totals["bare ctypes call (us)"] += [bl.fmt(v, 2) for v in medians(
                mine, context, lambda c: c["ctypes_call_us"])]
        lines += [f"\n### {context}-token context\n",
                  bl.table(header, list(rows.values()) + list(totals.values()))]
    return "\n".join(lines)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[3000, 6500])
    parser.add_argument("--kv-dtype", default="float16",
                        choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=24, help="tokens per block")
    parser.add_argument("--skip", type=int, default=3, help="warm-up tokens of each block")
    parser.add_argument("--inner", type=int, default=2, help="blocks of each kind a launch")
    parser.add_argument("--variants", type=int, nargs="+", default=list(range(len(VARIANTS))))
    parser.add_argument("--name", default="decode_components", help="the result files' name")
    parser.add_argument("--trees", nargs="+", default=[], metavar="LABEL=PATH",
                        help="source trees to import spmd_cp from, each variant launched "
                             "once per tree in every round (A/B of two checkouts); "
                             "default: this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.worker:
        worker(args)
        return
    command = bl.command_line("decode_components.py", sys.argv[1:])
    runs = []
    for _ in range(args.rounds):
        for column in columns(args):
            runs.append(launch(column, args))
            markdown = report(runs, args, command)
            bl.save(args.name, {"machine": bl.machine(), "command": command,
                                "runs": runs}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
