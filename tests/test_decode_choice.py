"""``--decode-tp auto``: the split decision from calibrated figures, pure and on real ranks."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from spmd_cp.attention.calibrate import DECODE_SAMPLES, low_quantile
from spmd_cp.engine.decode.decode_choice import (PackedReads, estimate_split, split_copy_bytes,
                                          split_matrix_bytes)
from spmd_cp.engine.decode.decode_plan import SPLIT_MARGIN
from spmd_cp.models.loader import load_model

SMOLLM2_MATRICES = 538_060_032  # bytes; SmolLM2-135M in float32 (docs/BENCHMARKS.md)


def test_split_pays_where_weight_reads_dominate_and_not_where_collectives_do():
    # This machine's kind of figures: ~5 GB/s per rank, ~60 us per small collective.
    cpu = estimate_split(SMOLLM2_MATRICES, 2, 30, 5e9, 60e-6)
    assert cpu.split
    assert cpu.saved_s == pytest.approx(0.5 * SMOLLM2_MATRICES / 5e9)
    assert cpu.cost_s == pytest.approx(91 * 60e-6)
    # A GPU streams the same weights 400x faster; a device sync per collective costs more.
    gpu = estimate_split(SMOLLM2_MATRICES, 2, 30, 2e12, 100e-6)
    assert not gpu.split and "91 more collectives" in gpu.reason
    # More ranks save more of the read (1 - 1/N), at the same number of collectives.
    assert estimate_split(SMOLLM2_MATRICES, 4, 30, 20e9, 150e-6).split
    assert not estimate_split(SMOLLM2_MATRICES, 2, 30, 20e9, 150e-6).split
    assert not estimate_split(SMOLLM2_MATRICES, 1, 30, 5e9, 60e-6).split
    assert not estimate_split(SMOLLM2_MATRICES, 2, 30, 0.0, 60e-6).split  # not measured


def test_a_margin_keeps_the_replicated_step_near_the_break_even_and_quantiles_interpolate():
    """Within the margin of the break-even the replicated layout stays (either decodes
    about as fast; the split one holds copies); past it the split is taken. The low
    quantile of samples is the order statistic's linear interpolation (numpy's default)."""
    import numpy as np

    # 91 collectives of 60 us = 5.46 ms; saved = 0.5 * W / stream
    near = estimate_split(SMOLLM2_MATRICES, 2, 30, SMOLLM2_MATRICES / 2 / 6e-3, 60e-6)
    assert near.split  # 6.0 > 5.46 ms
    assert not estimate_split(SMOLLM2_MATRICES, 2, 30, SMOLLM2_MATRICES / 2 / 6e-3, 60e-6,
                              margin=0.25).split  # 6.0 < 1.25 * 5.46
    assert estimate_split(SMOLLM2_MATRICES, 2, 30, SMOLLM2_MATRICES / 2 / 8e-3, 60e-6,
                          margin=0.25).split
    samples = [9.0, 1.0, 5.0, 3.0, 100.0, 2.0, 4.0]  # one sample under load: 100
    for q in (0.0, 0.25, 0.5, 1.0):
        assert low_quantile(samples, q) == pytest.approx(np.quantile(samples, q))
    assert low_quantile(samples, 0.25) == 2.5


def test_matrices_read_packed_count_at_their_measured_time():
    """A packed share is estimated at its measured seconds, not at the float32 read rate:
    all of SmolLM2 packed in 12 ms at N = 2 saves 6 ms, which 91 collectives of 80 us
    (7.3 ms) outweigh where the float32 figure (13.5 ms at 20 GB/s) would split; half of
    it packed counts the float32 half at the stream rate."""
    float32 = estimate_split(SMOLLM2_MATRICES, 2, 30, 20e9, 80e-6)
    packed = estimate_split(SMOLLM2_MATRICES, 2, 30, 20e9, 80e-6,
                            PackedReads(SMOLLM2_MATRICES, 12e-3))
    assert float32.split and not packed.split
    assert packed.saved_s == pytest.approx(6e-3)
    assert "538 MB of matrices: 0 MB at 20.0 GB/s, 538 MB read packed in 12.0 ms" in packed.reason
    half = estimate_split(SMOLLM2_MATRICES, 2, 30, 20e9, 80e-6,
                          PackedReads(SMOLLM2_MATRICES // 2, 6e-3))
    assert half.saved_s == pytest.approx(0.5 * (SMOLLM2_MATRICES / 2 / 20e9 + 6e-3))


def test_split_matrix_bytes_counts_the_projections_mlp_and_head(tiny_models):
    from mlx.utils import tree_flatten

    from spmd_cp.engine.model import CPModel
    from spmd_cp.models.loader import load_model

    for kind, tied in (("llama", True), ("qwen3", False)):
        model = load_model(tiny_models[kind]).model
        params = dict(tree_flatten(model.parameters()))
        split = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        expected = sum(v.nbytes for k, v in params.items() if k.split(".")[-2] in split)
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        assert ("lm_head.weight" in params) is not tied
        assert split_matrix_bytes(CPModel(model)) == expected + params[head].nbytes


def test_auto_measures_again_and_replaces_a_stale_calibration(tiny_models, tmp_path):
    """--decode-tp auto decides with the decode figures measured again at the decision,
    not with what a cached file says: a file 20x off (written under another load, say) is
    replaced, and its old figure does not reach the decision. The tokens equal one
    rank's either way."""
    env = {"SPMD_CP_CACHE": str(tmp_path)}
    args = ["generate", "--model", tiny_models["llama"], "--prompt", "The quick brown fox",
            "--max-tokens", "6", "--json", "--no-chat-template"]
    reference = run_cli(1, args, env=env).last_json()
    first = run_cli(2, args, env=env)  # measures and caches the calibration
    (path,) = tmp_path.glob("calibration-v5-*.json")
    record = json.loads(path.read_text())
    assert set(record) == {"attention_flops", "ring_bytes_per_s", "ring_latency_s",
                           "copy_bytes_per_s", "stream_bytes_per_s", "collective_s",
                           "transfer_drag", "measured_at", "load_average"}
    assert 0 <= record["transfer_drag"] < 1 and record["load_average"] >= 0
    assert first.last_json()["text"] == reference["text"]
    stale = 20 * max(record["collective_s"], 1e-3)
    path.write_text(json.dumps({**record, "collective_s": stale}))
    run = run_cli(2, args + ["--decode-comm", "mpi"], env=env)
    assert "the file is replaced" in run.stderr
    # the plan records what decided: the samples, their low quantile, the margin, the file
    plan = run.last_json()["decode_plan"]
    inputs = plan["inputs"]
    assert inputs["calibration_file"]["collective_s"] == pytest.approx(stale)
    assert inputs["collective_s"] < stale / 2, inputs
    samples = inputs["samples"]
    assert len(samples["collective_s"]) == len(samples["stream_bytes_per_s"]) == DECODE_SAMPLES
    # An added collective is costed as the step that runs it pays: the native step's
    # as a bare MPI request, sampled on its own.
    costed = samples["request_collective_s" if plan["step"] == "native" else "collective_s"]
    assert len(costed) == DECODE_SAMPLES
    assert inputs["collective_s"] == pytest.approx(low_quantile(costed, samples["quantile"]))
    assert inputs["margin"] == SPLIT_MARGIN and inputs["saved_s"] > 0 and inputs["cost_s"] > 0
    assert plan["layout"] == ("split" if inputs["saved_s"] > inputs["cost_s"] * (1 + SPLIT_MARGIN)
                              else "replicated")
    assert plan["reasons"]["layout"].startswith("auto: estimated per step")
    assert run.last_json()["decode_tp"] == {"split": "on", "replicated": "off"}[plan["layout"]]
    assert json.loads(path.read_text())["collective_s"] < stale / 2
    assert run.last_json()["text"] == reference["text"]
    # In MLX's graph the collectives are timed at the decision as well.
    run = run_cli(2, args + ["--decode-comm", "mlx"], env=env)
    assert run.last_json()["text"] == reference["text"]
    assert run.last_json()["decode_comm"] == "mlx"


def test_decode_is_readied_once_apart_only_when_a_decode_step_follows(tiny_models, tmp_path):
    """generate opens decode's collectives, decides and cuts the split step's slices
    after the prefill, before the first decode step, and reports that time as
    decode_setup_s (not in decode_tok_s); with one token to generate there is no decode
    step to ready."""
    env = {"SPMD_CP_CACHE": str(tmp_path)}
    args = ["generate", "--model", tiny_models["llama"], "--prompt", "The quick brown fox",
            "--json", "--no-chat-template", "--decode-tp", "on"]
    one_rank = run_cli(1, args + ["--max-tokens", "6"], env=env)
    reference = one_rank.last_json()
    run = run_cli(2, args + ["--max-tokens", "6"], env=env)
    log = run.stderr
    assert log.index("prefill attention:") < log.index(
        "tensor-parallel slices of the float32 weights")
    summary = run.last_json()
    assert summary["decode_tp"] == "on" and summary["decode_setup_s"] > 0
    assert summary["token_ids"] == reference["token_ids"]
    # The split step's own memory (down columns; the rows are views) is what the
    # forecast added to the weights, and what model_bytes reports beyond them.
    loaded = load_model(tiny_models["llama"]).model
    copies = split_copy_bytes(loaded.model, 2)
    replicated = reference["model_bytes"][0]
    assert 0 < copies < replicated // 4
    assert summary["memory_forecast"]["weights_bytes"] == replicated + copies
    assert max(summary["model_bytes"]) == replicated + copies
    assert reference["memory_forecast"]["weights_bytes"] == replicated
    # one rank: the plan is made (the step built), with no collectives and no split
    assert reference["decode_setup_s"] > 0
    assert reference["decode_plan"]["transport"] == "none"
    assert reference["decode_plan"]["reasons"]["layout"] == "one rank"
    assert summary["decode_plan"]["reasons"]["layout"] == "--decode-tp on"
    single = run_cli(2, args + ["--max-tokens", "1"], env=env)
    assert single.last_json()["decode_setup_s"] == 0.0
    assert single.last_json()["decode_plan"] is None
    assert "slices" not in single.stderr and "decode plan" not in single.stderr
    assert single.last_json()["token_ids"] == reference["token_ids"][:1]
