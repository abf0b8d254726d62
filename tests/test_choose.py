"""``--cp-algo auto`` against every recorded prefill-algorithm cell. Pure.

Each cell of benchmarks/results/{prefill_algos,network}{,_xeon}.json (docs/BENCHMARKS.md),
prefill_algos_old_tiling.json and the short follow-up re-runs (``*_followup_*``, before
and after the transfer drag joined the calibration) records the prefill times of every
algorithm (one per round) and the calibration the ranks measured for that run (C, BW,
ring latency). The choice, fed those measurements,
must name an algorithm within 5% of the fastest. Not every run recorded a copy rate or
a transfer drag (calibration measures them since): the choice must hold over the whole
range of host copy rates seen on such machines (1-16 GB/s) and of drags measured on this
one (0.14-0.52: 0.1 to 0.5), and with a ring step latency ten times the recorded raw
Sendrecv (the calibrated one now includes the hand-off to the communication thread; a
blocking collective keeps the raw latency).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spmd_cp.attention.choose import (EXTRA_MARGIN, LinkAndCompute, choose_prefill_algo,
                                      estimate_layer_seconds)

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# SmolLM2-135M, the model of every recorded run: 9 query heads, 3 KV heads, d = 64, float32.
HEADS, KV_HEADS, HEAD_DIM, ELEM = 9, 3, 64, 4
# Recorded with the attention tiling the package ships (the _old_tiling file is not).
SHIPPED_TILING = ("prefill_algos", "prefill_algos_xeon", "network",
                  "network_xeon", "network_followup_4gbit_no_drag",
                  "network_followup_4gbit_drag", "network_followup_1_16gbit_drag",
                  "prefill_algos_followup_no_drag", "prefill_algos_followup_drag")
RECORDS = SHIPPED_TILING + ("prefill_algos_old_tiling",)


def recorded_cells():
    cells = []
    for name in RECORDS:
        data = json.loads((RESULTS / f"{name}.json").read_text())
        for key, runs in data["runs"].items():
            runs = runs if isinstance(runs, list) else [runs]
            times = {}
            for run in runs:
                for algo, result in run["results"].items():
                    times.setdefault(algo, []).extend(result["times_s"])
            first = runs[0]
            cells.append({"name": f"{name}:{key}", "file": name, "new": first["new"],
                          "cached": first["cached"], "ranks": first["ranks"],
                          "measured": first["auto"]["measured"], "times": times})
    return cells


CELLS = recorded_cells()


def test_the_recorded_cells_are_the_documented_ones():
    # 2 + 2 + 2 cells over shared memory, 6 + 6 over the simulated links (the AMD EPYC
    # runs, which record a copy rate, and the Intel Xeon ones, which do not), and the
    # re-runs of the short follow-ups: 2 over shared memory, 4 over the links.
    assert len(CELLS) == 24
    assert {c["name"] for c in CELLS} >= {"prefill_algos:128:2048", "network:4gbit|64:2048",
                                          "network:16gbit|64:2048",
                                          "network_xeon:4gbit|64:2048",
                                          "network_followup_4gbit_no_drag:4gbit|64:2048",
                                          "network_followup_4gbit_drag:4gbit|64:2048"}


@pytest.mark.parametrize("drag", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("copy_gbps", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("latency_factor", [1, 10])
@pytest.mark.parametrize("cell", CELLS, ids=[c["name"] for c in CELLS])
def test_auto_picks_the_measured_fastest_in_every_recorded_cell(cell, copy_gbps,
                                                               latency_factor, drag):
    m = cell["measured"]
    copy = m.get("copy_bytes_per_s", copy_gbps * 1e9)  # the AMD EPYC runs recorded theirs
    measured = LinkAndCompute(m["attention_flops"], m["ring_bytes_per_s"],
                              latency_factor * m["ring_latency_s"], copy,
                              collective_s=m.get("collective_s") or m["ring_latency_s"],
                              transfer_drag=m.get("transfer_drag", drag))  # the drag re-runs
    algo, reason = choose_prefill_algo(cell["new"], cell["cached"], cell["ranks"], HEADS,
                                       KV_HEADS, ELEM, measured, HEAD_DIM)
    # Best of the rounds: other processes' load only ever adds time.
    best = {a: min(t) for a, t in cell["times"].items()}
    assert best[algo] <= 1.05 * min(best.values()), (algo, best, reason)
    if cell["file"] in SHIPPED_TILING:
        median = {a: float(np.median(t)) for a, t in cell["times"].items()}
        assert median[algo] <= 1.05 * min(median.values()), (algo, median, reason)


def test_without_the_copy_cost_and_the_margin_the_follow_ups_go_wrong():
    """What the old rule lacked: with free copies and no margin for the model's error,
    pass-kv is chosen for short follow-ups where it measured 1.03-1.17x pass-q's time.
    The AMD EPYC runs' calibration records its copy rate: there the copy term alone did not
    suffice (4 Gbit/s: pass-kv's addition estimated 12% below pass-q's, pass-kv measured
    1.08-1.12x), the margin does."""
    def wrong_cells(free_copies: bool, margin: float) -> list:
        wrong = []
        for cell in CELLS:
            m = cell["measured"]
            if not free_copies and "copy_bytes_per_s" not in m:
                continue  # no recorded copy rate (the sweep above covers these cells)
            copy = float("inf") if free_copies else m["copy_bytes_per_s"]
            measured = LinkAndCompute(m["attention_flops"], m["ring_bytes_per_s"],
                                      m["ring_latency_s"], copy,
                                      collective_s=m.get("collective_s", 0.0))  # no drag
            algo, _ = choose_prefill_algo(cell["new"], cell["cached"], cell["ranks"], HEADS,
                                          KV_HEADS, ELEM, measured, HEAD_DIM, margin=margin)
            best = {a: min(t) for a, t in cell["times"].items()}
            if best[algo] > 1.05 * min(best.values()):
                wrong.append(cell["name"])
        return wrong

    assert {"prefill_algos_xeon:128:2048",
            "network_xeon:4gbit|64:2048"} <= set(wrong_cells(True, 0.0))
    assert "network:4gbit|64:2048" in wrong_cells(False, 0.0)  # as recorded: copy 12.5 GB/s
    # The margin alone (no drag) still misses the two re-runs of that cell: see the next
    # test.
    assert wrong_cells(False, EXTRA_MARGIN) == ["network_followup_4gbit_no_drag:4gbit|64:2048",
                                                "network_followup_4gbit_drag:4gbit|64:2048"]


def test_the_transfer_drag_turns_the_4gbit_follow_up_to_pass_q():
    """A re-run of the 4 Gbit/s follow-up (64 new tokens on 2,048 cached) with the
    margin: pass-kv still chosen, 1.059x pass-q's time, because a transfer the attention
    hides still slows it (MPI's progress loop and TCP on the two cores). Calibrated, that
    drag (0.24-0.26 there) charges pass-kv's 10x larger transfer and names pass-q, the
    fastest, in both re-runs that measured it."""
    def choice(cell, drag):
        m = cell["measured"]
        measured = LinkAndCompute(m["attention_flops"], m["ring_bytes_per_s"],
                                  m["ring_latency_s"], m["copy_bytes_per_s"],
                                  collective_s=m["collective_s"], transfer_drag=drag)
        return choose_prefill_algo(cell["new"], cell["cached"], cell["ranks"], HEADS,
                                   KV_HEADS, ELEM, measured, HEAD_DIM)[0]

    cells = {c["name"]: c for c in CELLS}
    before = cells["network_followup_4gbit_no_drag:4gbit|64:2048"]
    after = cells["network_followup_4gbit_drag:4gbit|64:2048"]
    assert before["measured"]["copy_bytes_per_s"] > 0 and "transfer_drag" not in before["measured"]
    assert choice(before, 0.0) == "pass-kv"  # what that run chose: 1.059x the fastest
    assert choice(before, 0.25) == choice(after, after["measured"]["transfer_drag"]) == "pass-q"
    best = {a: min(t) for a, t in after["times"].items()}
    assert best["pass-q"] == min(best.values())


def test_estimates_grow_with_latency_per_ring_step():
    """The latency term: (N-1) ring steps per layer that nothing hides when attention is
    short, so a slower link step shows in both estimates, N-1 times per layer."""
    fast = LinkAndCompute(1e10, 1e10, 10e-6, 4e9, collective_s=10e-6)
    slow = LinkAndCompute(1e10, 1e10, 1e-3, 4e9, collective_s=1e-3)
    for n in (2, 4, 8):
        quick = estimate_layer_seconds(4, 0, n, HEADS, KV_HEADS, ELEM, fast, HEAD_DIM)
        lagged = estimate_layer_seconds(4, 0, n, HEADS, KV_HEADS, ELEM, slow, HEAD_DIM)
        assert lagged["pass-kv"] - quick["pass-kv"] == pytest.approx((n - 1) * (1e-3 - 10e-6),
                                                                      rel=0.01)
        # pass-q also pays the Alltoallv that returns the partials.
        assert lagged["pass-q"] - quick["pass-q"] == pytest.approx(n * (1e-3 - 10e-6), rel=0.01)


def test_a_covered_transfer_costs_its_drag():
    """``transfer_drag``: the share of attention a transfer slows while it runs, charged
    for the covered part of each algorithm's ring transfer (the uncovered part in full)."""
    plain = LinkAndCompute(1e10, 1e9, 10e-6, 4e9, collective_s=10e-6)
    dragged = LinkAndCompute(1e10, 1e9, 10e-6, 4e9, collective_s=10e-6, transfer_drag=0.5)
    n, new, cached = 2, 64, 4096
    base = estimate_layer_seconds(new, cached, n, HEADS, KV_HEADS, ELEM, plain, HEAD_DIM)
    slow = estimate_layer_seconds(new, cached, n, HEADS, KV_HEADS, ELEM, dragged, HEAD_DIM)
    window = base["attention"] * (n - 1) / n
    kv = 2 * (new + cached) / n * KV_HEADS * HEAD_DIM * ELEM
    q = new / n * HEADS * HEAD_DIM * ELEM
    for algo, transfer in (("pass-kv", 10e-6 + kv / 1e9), ("pass-q", 10e-6 + q / 1e9)):
        assert transfer < window  # covered: without drag it adds nothing here
        assert slow["extra"][algo] - base["extra"][algo] == pytest.approx(0.5 * transfer)


def test_auto_counts_what_sliding_window_layers_send():
    """A model of Gemma 3 1B's attention shape (26 layers, every sixth global, 4 query
    heads over one KV head of 256, window 512) on 4 ranks. The keys ``window_traffic``
    reads from the model's layers and the head-tail positions equal a brute-force count
    of the keys each rank's queries see through the window from other ranks (what the
    window exchange sends, ``window_kv_bytes``). Counting them turns auto's choice from
    pass-q to pass-kv: on bytes alone for a long follow-up, and on the measured estimate
    for a short one; the reason says so."""
    from mlx_lm.models import gemma3_text

    from spmd_cp.attention import window_traffic
    from spmd_cp.attention.partition import head_tail_positions
    from spmd_cp.engine.model import CPModel

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=26,
                                 intermediate_size=64, num_attention_heads=4, head_dim=256,
                                 num_key_value_heads=1, vocab_size=64, sliding_window=512)
    model = CPModel(gemma3_text.Model(args))
    n, window = 4, 512
    shape = (model.num_heads, model.num_kv_heads, model.elem_bytes)
    assert shape == (4, 1, 4)

    def positions(new, cached):
        first = head_tail_positions(cached, n)
        query = head_tail_positions(new, n, cached, [p.size for p in first])
        return [np.concatenate([a, b]) for a, b in zip(first, query)], query

    cached_positions, query_positions = positions(512, 7680)
    traffic = window_traffic(model, cached_positions, query_positions)
    def seen_by(keys, queries):  # every (key, query) pair tried
        gap = queries[None, :] - keys[:, None]
        return int(((gap >= 0) & (gap < window)).any(axis=1).sum())

    seen = np.array([[0 if s == r else seen_by(cached_positions[s], query_positions[r])
                      for r in range(n)] for s in range(n)])  # [sender, receiver]
    busiest = max(seen.sum(axis=0).max(), seen.sum(axis=1).max())
    assert (traffic.layers, traffic.local, traffic.window, traffic.keys) == (26, 22, 512, busiest)
    assert window_traffic(model, cached_positions[:1], query_positions[:1]) is None

    long_new, long_cached = 4096, 12288  # T/(T+P) = 0.25 < 2 NKV / NH = 0.5
    cached_positions, query_positions = positions(long_new, long_cached)
    traffic = window_traffic(model, cached_positions, query_positions)
    plain = choose_prefill_algo(long_new, long_cached, n, *shape, None, 256)
    algo, reason = choose_prefill_algo(long_new, long_cached, n, *shape, None, 256,
                                       windowed=traffic)
    assert plain[0] == "pass-q" and algo == "pass-kv"
    assert f"22 of 26 layers windowed (W = 512): pass-kv sends {traffic.keys} keys" in reason

    # 1,024 on 7,168: the windows send more than pass-q on average (3.7 against 3 MiB),
    # and save the ring's copies: the estimate decides.
    link = LinkAndCompute(attention_flops=2e10, ring_bytes_per_s=2e9, ring_latency_s=50e-6,
                          copy_bytes_per_s=4e9, collective_s=50e-6, transfer_drag=0.25)
    short_new, short_cached = 1024, 7168
    cached_positions, query_positions = positions(short_new, short_cached)
    traffic = window_traffic(model, cached_positions, query_positions)
    plain = choose_prefill_algo(short_new, short_cached, n, *shape, link, 256)
    algo, reason = choose_prefill_algo(short_new, short_cached, n, *shape, link, 256,
                                       windowed=traffic)
    assert plain[0] == "pass-q" and algo == "pass-kv", (plain, reason)
    assert "estimated per layer" in reason and "layers windowed" in reason
    times = estimate_layer_seconds(short_new, short_cached, n, *shape, link, 256, traffic)
    local_send = 2 * traffic.keys * 256 * 4
    assert times["extra"]["pass-kv"] == pytest.approx(
        (4 / 26) * estimate_layer_seconds(short_new, short_cached, n, *shape, link,
                                          256)["extra"]["pass-kv"]
        + (22 / 26) * (50e-6 + local_send / 2e9 + 2 * local_send / 4e9))
