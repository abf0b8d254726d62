"""`spmd-cp doctor`'s human-readable report (rank 0): the rank table, what every rank
shares, the mismatches and warnings, the calibration and what --cp-algo auto will do
with it."""

from __future__ import annotations

from .doctor_checks import COMPARED, EXIT_MISMATCH


def _gflops(rate: float) -> str:
    return f"{rate / 1e9:.2f} GFLOP/s"


def rank_table(s: dict) -> list[str]:
    """One aligned row per rank: host, pid, BLAS, threads, attention speed, model sha256."""
    rows = [("rank", "host", "pid", "BLAS", "threads", "attention", "model sha256")]
    for r in range(s["ranks"]):
        checksum = s["model_checksum"][r]
        rows.append((str(r), s["host"][r], str(s["pid"][r]), s["blas"][r],
                     str(s["blas_threads"][r] or "?"), _gflops(s["attention_flops"][r]),
                     checksum[:16] if checksum else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def calibration_lines(s: dict) -> list[str]:
    """The measured link and compute, where they came from, and the auto choice."""
    n, hosts, c = s["ranks"], s["hosts"], s["calibration"]
    out = []
    if n > 1:
        out.append(f"ring Sendrecv (rank r -> r+1, slowest link): "
                   f"{c['ring_bytes_per_s'] / 1e9:.3f} GB/s per direction, "
                   f"{c['ring_latency_s'] * 1e6:.0f} us per small step")
        out.append(f"small collective through mpi4py: {c['collective_s'] * 1e6:.0f} us; a ring "
                   f"transfer slows attention by {100 * c['transfer_drag']:.0f}% while it runs")
        graph = s.get("decode_collectives")
        if graph and graph["opened"]:
            out.append(f"decode collectives in MLX's graph: {graph['reason']}, "
                       f"{graph['latency_s'] * 1e6:.0f} us each")
        elif graph:
            out.append(f"decode collectives through mpi4py: {graph['reason']}")
    out.append(f"weight reads {c['stream_bytes_per_s'] / 1e9:.1f} GB/s per rank (all ranks at "
               f"once); host copies {c['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    out.append(f"attention (slowest rank): {_gflops(c['attention_flops'])}")
    now = c.get("decode_now")
    if now:
        collective = (f"collective {now['collective_s'] * 1e6:.0f} us, "
                      if now["collective_s"] is not None else "")
        out.append(f"decode figures measured now ({collective}weight reads "
                   f"{now['stream_bytes_per_s'] / 1e9:.1f} GB/s): --decode-tp auto decides "
                   "with these")
    if c["source"] == "cache":
        taken = (f", measured {c['measured_at']} under load {c['load_average']}"
                 if c.get("measured_at") else "")
        out.append(f"calibration: read from {c['file']}{taken} "
                   "(`spmd-cp doctor --recalibrate` measures again)")
    else:
        out.append(f"calibration: measured now ({c['seconds']:.1f} s), written to {c['file']}")
    out.append(f"  (--cp-algo auto reads it whenever {n} rank{'s' if n != 1 else ''} run on "
               f"{'these hosts' if len(hosts) > 1 else 'this host'})")
    out += describe_weight_layout(s["weights"], n)
    plan = s.get("decode_plan")
    if plan is not None:
        out.append(f"decode plan for this model (default flags): {plan['layout']} layout, "
                   f"{plan['step']} step, {plan['transport']} collectives, "
                   f"{plan['requests']} requests, {plan['merge']} merge; "
                   f"{plan['kv_dtype']} KV cache")
        out += [f"  {choice}: {why}" for choice, why in plan["reasons"].items()]
    a = s["auto"]
    if a is not None:
        out.append("")
        out.append(f"auto choice for this model (NH={a['num_heads']} query heads, "
                   f"NKV={a['num_kv_heads']} KV heads, {a['elem_bytes']}-byte K/V) on {n} "
                   f"rank{'s' if n != 1 else ''}:")
        out += ["  " + line for line in describe_crossover(a)]
    return out


def describe_crossover(a: dict) -> list[str]:
    """Sentences for an ``auto_crossover`` result."""
    if a["cp_size"] == 1:
        return ["one rank: no communication, nothing to choose (pass-kv)"]
    share = a["share_threshold"]
    rule = f"T/(T+P) < 2*NKV/NH = {share:.3f}"
    lines = [f"pass-kv whenever the T new tokens are at least {share:.1%} of the context "
             f"(T/(T+P) >= 2*NKV/NH) on P cached tokens"]
    limit = a["pass_q_below_tokens"]
    if limit is None:
        lines.append(f"pass-q is chosen for every follow-up with {rule}")
    elif limit <= 1:
        lines.append("pass-q is never chosen: even one new token's attention hides the K/V "
                     "transfer on this link")
    else:
        lines.append(f"pass-q is chosen for follow-ups of T < {limit} new tokens on P cached "
                     f"when {rule};")
        lines.append(f"from T >= {limit} the K/V transfer hides under attention compute "
                     "(T >= N*C*NKV*e/(2*NH*BW)) and pass-kv wins")
    return lines


def describe_weight_layout(w: dict | None, n: int) -> list[str]:
    """Lines on the weights one rank holds, replicated and layer-sharded."""
    if w is None:
        return []
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    lines = ["", "weights per rank (as loaded without --keep-quantized): "
                 f"{gb(w['replicated_bytes'])} replicated"]
    if w["sharded_bytes"] is None:
        return lines + ["  one rank: nothing to shard"]
    lines.append(f"  --shard-weights on: {gb(w['sharded_bytes'])} at peak on {n} ranks (its "
                 f"layers i mod {n}, 1/{n} of the vocabulary, {w['prefetch_layers'] + 1} "
                 "layers in flight)")
    shards = w["auto_shards"]
    lines.append(f"  --shard-weights auto {'shards' if shards else 'keeps them replicated'} "
                 f"(the replicated weights and the process's own memory "
                 f"{'exceed' if shards else 'fit'} the default --memory-limit, "
                 f"{gb(w['memory_limit_bytes'])} per rank)")
    return lines


def grid_lines(grid: dict | None) -> list[str]:
    """The CP x TP grid ``--tp`` asked for, the roles of ``--afd`` (none without them)."""
    afd = (grid or {}).get("afd")
    if afd and not afd["error"]:
        return [f"roles (--afd {afd['afd']}): attention ranks {afd['attention_ranks']} on "
                f"{', '.join(afd['attention_hosts'])}; FFN ranks {afd['ffn_ranks']} on "
                f"{', '.join(afd['ffn_hosts'])} (no KV; the MLPs or experts)", ""]
    if grid is None or grid["tp"] == 1 or grid["error"]:
        return []
    groups = " ".join("[" + ", ".join(map(str, g)) + "]" for g in grid["tp_groups"])
    where = "each on one host" if not grid["tp_groups_across_hosts"] else "some across hosts"
    return [f"grid (--tp {grid['tp']}): {grid['cp']} context-parallel group(s) x "
            f"{grid['tp']} tensor-parallel ranks; TP groups {groups}, {where}", ""]


def print_report(s: dict):
    """The human-readable report (rank 0, stdout)."""
    n, hosts = s["ranks"], s["hosts"]
    out = [f"spmd-cp doctor: {n} rank{'s' if n != 1 else ''} on {len(hosts)} "
           f"host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts)})", ""]
    out += rank_table(s) + [""]
    labels = dict(COMPARED)
    out.append("same on every rank:" if not s["problems"] else "rank 0 has:")
    for key in ("spmd_cp", "python", "mlx", "mlx_lm", "mpi4py", "mpi_library", "backend",
                "device", "compute_path", "scheduling", "allocator", "huge_pages",
                "quantized_decode", "native_decode", "model_path", "model_checksum"):
        values = s[key]
        mark = "" if len(set(values)) == 1 else "   (differs)"
        label = labels.get(key, key.replace("_", " ")).replace(" version", "")
        if key == "model_path":
            label = "model"
            mark = "" if len(set(values)) == 1 else "   (paths differ; checksums are compared)"
        out.append(f"  {label:<15} {values[0]}{mark}")
    out.append("")
    if s["problems"]:
        out += [f"MISMATCH (exit status {EXIT_MISMATCH}):"] + [f"  {p}" for p in s["problems"]]
        out.append("")
    out += grid_lines(s.get("grid"))
    if s["warnings"]:
        out += ["warnings:"] + [f"  {w}" for w in s["warnings"]] + [""]
    out += calibration_lines(s)
    print("\n".join(out), flush=True)
