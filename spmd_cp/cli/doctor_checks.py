"""`spmd-cp doctor`'s comparison of the ranks' reports (pure, standard library only):
what must be equal on every rank, and what differs in a way that costs speed."""

from __future__ import annotations

EXIT_MISMATCH = 3

# (report key, label): fields that must be equal on every rank. A different model file
# breaks exactness outright; a different spmd-cp / MLX / mlx-lm can compute differently
# or disagree on the message sequence; a different MPI or mpi4py can fail to interoperate.
COMPARED = (
    ("model_checksum", "model checksum"),
    ("spmd_cp", "spmd-cp version"),
    ("mlx", "MLX version"),
    ("mlx_lm", "mlx-lm version"),
    ("mpi4py", "mpi4py version"),
    ("mpi_library", "MPI library"),
    ("python", "Python version"),
    ("compute_path", "compute path"),  # fixes the KV dtype: the messages' layout
)

# A rank this much slower at attention than the fastest one holds up every ring step
# (smaller gaps are within the noise of a shared machine).
SLOW_RANK_FACTOR = 3.0


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _hosts_of(ranks: list[int], reports: list[dict]) -> str:
    hosts = list(dict.fromkeys(reports[r]["host"] for r in ranks))
    return ("host " if len(hosts) == 1 else "hosts ") + ", ".join(hosts)


def _short(key: str, value) -> str:
    return value[:16] + "..." if key == "model_checksum" and value else str(value)


def find_mismatches(reports: list[dict]) -> list[str]:
    """One sentence per field that differs between ranks (empty when all agree).

    The value most ranks have (ties: the one rank 0 has) is the reference; the sentence
    names the other ranks first, e.g. "model checksum differs: rank 2 (host b) has
    1a2b..., ranks 0,1 have 9f8e...".
    """
    problems = []
    for rank, report in enumerate(reports):
        if report.get("model_error"):
            problems.append(f"model unusable on rank {rank} ({_hosts_of([rank], reports)}): "
                            f"{report['model_error']}")
    for key, label in COMPARED:
        groups: dict = {}
        for rank, report in enumerate(reports):
            if key == "model_checksum" and report.get("model_error"):
                continue  # already reported above
            groups.setdefault(report.get(key), []).append(rank)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
        (reference, reference_ranks), others = ordered[0], ordered[1:]
        parts = [f"{_rank_list(ranks)} ({_hosts_of(ranks, reports)}) "
                 f"{'has' if len(ranks) == 1 else 'have'} {_short(key, value)}"
                 for value, ranks in sorted(others, key=lambda item: item[1][0])]
        parts.append(f"{_rank_list(reference_ranks)} "
                     f"{'has' if len(reference_ranks) == 1 else 'have'} "
                     f"{_short(key, reference)}")
        problems.append(f"{label} differs: " + ", ".join(parts))
    return problems


def find_warnings(reports: list[dict], flops: list[float]) -> list[str]:
    """Differences that do not break exactness but cost speed."""
    warnings = []
    for rank, report in enumerate(reports):
        slow = not report["blas_fast"] and report["blas_kind"] != "accelerate"
        if slow or report["gemv_forward_skipped"]:  # the line says why
            warnings.append(f"rank {rank} ({report['host']}): {report['blas_line']}")
    for key in ("quantized_decode", "native_decode"):
        if len({report[key] for report in reports}) > 1:
            warnings.append(key.replace("_", " ") + " differs between ranks (" + "; ".join(
                f"{_rank_list([r])}: {report[key]}" for r, report in enumerate(reports))
                + "): the slowest rank sets the pace")
    kinds = {report["blas"] for report in reports}
    if len(kinds) > 1:
        warnings.append("BLAS differs between ranks (" + "; ".join(
            f"{_rank_list([r])}: {report['blas']}" for r, report in enumerate(reports))
            + "): the slowest rank sets the pace")
    by_host: dict = {}
    for rank, report in enumerate(reports):
        by_host.setdefault(report["host"], []).append(rank)
    for host, ranks in by_host.items():
        threads = sum(reports[r]["blas_threads"] or 1 for r in ranks)
        cpus = reports[ranks[0]]["cpus"]
        if threads > cpus:
            warnings.append(f"host {host}: {len(ranks)} ranks use {threads} BLAS threads in all "
                            f"on {cpus} CPUs (oversubscribed: set OPENBLAS_NUM_THREADS, or "
                            "launch with launch/spmd-cp-run)")
    fastest = max(flops)
    for rank, rate in enumerate(flops):
        if rate * SLOW_RANK_FACTOR < fastest:
            warnings.append(f"rank {rank} ({reports[rank]['host']}) computes attention "
                            f"{fastest / rate:.1f}x slower than the fastest rank: every ring "
                            "step waits for it")
    return warnings


def grid_report(hosts: list[str], tp: int) -> dict:
    """``--tp``'s grid over these ranks (``hosts``: each rank's host, in rank order): its
    TP groups, those that span hosts (their Allreduces then cross a link), or why ``tp``
    cannot form groups."""
    from ..runtime.grid import grid_obstacle

    why = grid_obstacle(tp, len(hosts))
    if why:
        return {"tp": tp, "error": why}
    groups = [list(range(g, g + tp)) for g in range(0, len(hosts), tp)]
    across = [g for g in groups if len({hosts[r] for r in g}) > 1]
    return {"tp": tp, "cp": len(hosts) // tp, "tp_groups": groups,
            "tp_groups_across_hosts": across, "error": None}


def afd_report(hosts: list[str], spec: str) -> dict:
    """``--afd``'s roles over these ranks: which run attention and which the feed-forward,
    and the hosts of each (or why ``spec`` cannot split them)."""
    from ..runtime.afd import AfdRoles, afd_obstacle

    why = afd_obstacle(spec, len(hosts))
    if why:
        return {"afd": spec, "error": why}
    roles = AfdRoles.of(spec, len(hosts))
    attention = list(range(roles.attention))
    ffn = list(range(roles.attention, len(hosts)))
    return {"afd": spec, "attention_ranks": attention, "ffn_ranks": ffn,
            "attention_hosts": sorted({hosts[r] for r in attention}),
            "ffn_hosts": sorted({hosts[r] for r in ffn}), "error": None}


def grid_warnings(grid: dict) -> list[str]:
    if grid["error"]:
        return [grid["error"]]
    return [f"--tp {grid['tp']}: ranks {', '.join(map(str, g))} form a tensor-parallel group "
            "across hosts (its 2 Allreduces a layer cross the link): give each host a "
            "multiple of T consecutive slots" for g in grid["tp_groups_across_hosts"]]

