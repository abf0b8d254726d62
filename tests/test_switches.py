"""The run's switches are flags: ``--attention-kernel`` reaches every rank's attention,
the retired variables map onto their flags for one more release, and
``--decode-step native`` where it cannot run is refused before the heavy work, in one
line."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import run_cli


def test_attention_kernel_flag_reaches_the_ranks(tiny_models, tmp_path):
    """--attention-kernel fused on the CPU path: two ranks score a document through MLX's
    fused kernel over the pass-KV ring (the path's default is the tiled blocks), say so,
    and equal mlx-lm's forward."""
    from test_gpu_path import mlx_lm_logprobs

    text = "the quick brown fox jumps over the lazy dog " * 12
    (tmp_path / "doc.txt").write_text(text)
    out = tmp_path / "scores.jsonl"
    summary = run_cli(2, ["score", "--model", tiny_models["llama"], "--text-file",
                          str(tmp_path / "doc.txt"), "--output", str(out), "--cp-algo",
                          "pass-kv", "--json", "--device", "cpu", "--attention-kernel",
                          "fused"]).last_json()
    assert (summary["compute_path"], summary["attention_kernel"]) == ("cpu", "fused")
    assert summary["kv_dtype"] == "float32"  # --kv-dtype auto: score decodes nothing
    assert summary["prefill_chunk"] == 0  # --prefill-chunk auto: the whole prompt here
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids, reference, _ = mlx_lm_logprobs(tiny_models["llama"], text)
    assert [r["token"] for r in records] == ids[1:].tolist()
    np.testing.assert_allclose([r["logprob"] for r in records], reference, rtol=1e-4,
                               atol=1e-4)


def test_retired_variables_map_onto_their_flags(monkeypatch, capsys):
    """Each retired variable sets its field where the flag is at its default (a flag
    given wins), with one warning line naming the flag; a value it never took is a
    one-line error naming the flag."""
    from spmd_cp.cli.retired import honour_retired
    from spmd_cp.config import RunConfig
    from spmd_cp.errors import UserError

    monkeypatch.setenv("SPMD_CP_PATH", " GPU")
    monkeypatch.setenv("SPMD_CP_ATTENTION", "tiled")
    monkeypatch.setenv("SPMD_CP_WEIGHT_CACHE", "0")
    run = honour_retired(RunConfig(attention_kernel="fused"), speaks=True)
    assert (run.device, run.attention_kernel, run.weight_cache) == ("gpu", "fused", False)
    warnings = capsys.readouterr().err.splitlines()
    assert [line.split(": use ")[1] for line in warnings] == [
        "--device gpu", "--attention-kernel tiled", "--no-weight-cache"]
    assert all(line.startswith("spmd-cp: warning: SPMD_CP_") and "deprecated" in line
               for line in warnings)
    assert honour_retired(RunConfig(), speaks=False).attention_kernel == "tiled"
    assert capsys.readouterr().err == ""  # ranks other than 0 print nothing
    monkeypatch.setenv("SPMD_CP_WEIGHT_CACHE", "1")
    assert honour_retired(RunConfig(), speaks=False).weight_cache is True
    monkeypatch.setenv("SPMD_CP_PATH", "tpu")
    with pytest.raises(UserError, match=r"SPMD_CP_PATH='tpu': expected one of gpu, cpu.*--device"):
        honour_retired(RunConfig(), speaks=False)


def test_native_decode_where_it_cannot_run_fails_before_the_heavy_work(tiny_models):
    """--decode-step native on the GPU path: one error line naming why, before the model
    is loaded."""
    launch = run_cli(1, ["generate", "--prompt", "hello", "--max-tokens", "2", "--model",
                         tiny_models["llama"], "--decode-step", "native", "--device", "gpu"],
                     check=False)
    assert launch.returncode == 2, launch.stderr
    errors = [line for line in launch.stderr.splitlines() if "error" in line]
    assert errors == ["spmd-cp: error: --decode-step native: the GPU path"], launch.stderr
    assert "loaded in" not in launch.stderr, launch.stderr


def test_native_decode_over_layers_it_cannot_run_is_refused_as_the_engine_is_built(
        tiny_models):
    """Where the model's own layers rule the native step out (a layer kept as MLX's
    4-bit QuantizedLinear), the engine is refused as it is built, before any prompt is
    prefilled, by the rule the decode plan applies."""
    import mlx.nn as nn
    from mpi4py import MPI

    from spmd_cp.config import DecodeConfig, RunConfig
    from spmd_cp.errors import UserError
    from spmd_cp.models.loader import load_model
    from spmd_cp.run.builder import make_engine, settle_run
    from spmd_cp.runtime.comm import Comm

    comm = Comm(MPI.COMM_SELF)
    loaded = load_model(tiny_models["llama"])
    nn.quantize(loaded.model.model.layers[1], group_size=32, bits=4)
    native = DecodeConfig(decode_step="native")
    with pytest.raises(UserError, match=r"^--decode-step native: rank 0: layer 1: q_proj is "
                                        r"a QuantizedLinear of uint32"):
        make_engine(comm, loaded, settle_run(comm, loaded, RunConfig(), native), native)
    run = settle_run(comm, loaded, RunConfig(), DecodeConfig())
    assert run.kv_dtype == "float32"  # the model rules the native step out: MLX's cache
    assert make_engine(comm, loaded, run).plan is None  # auto: built


def test_kv_dtype_auto_is_float32_where_decode_is_not_native(tiny_models, tiny_gemma3_models):
    """--kv-dtype auto (the default) settles once, before the engine: float32 where no
    decode steps follow (score), where the step is MLX's (--decode-step graph, Gemma 3's
    layers); a dtype given is kept. (Where decode runs natively it is float16: the CLI's
    runs show it, test_decode.py; this process has no BLAS for the C step to bind.)"""
    from mpi4py import MPI

    from spmd_cp.config import DecodeConfig, RunConfig
    from spmd_cp.models.loader import load_model
    from spmd_cp.run.builder import make_engine, settle_run
    from spmd_cp.runtime.comm import Comm

    comm = Comm(MPI.COMM_SELF)
    llama = load_model(tiny_models["llama"])
    gemma = load_model(tiny_gemma3_models["gemma3_text"])

    def settled(loaded, decode, **run):
        return settle_run(comm, loaded, RunConfig(**run), decode).kv_dtype

    assert RunConfig().kv_dtype == "auto"
    assert settled(llama, None) == "float32"
    assert settled(llama, DecodeConfig(decode_step="graph")) == "float32"
    assert settled(gemma, DecodeConfig()) == "float32"
    assert settled(llama, DecodeConfig(decode_step="graph"), kv_dtype="bfloat16") == "bfloat16"
    # the engine reads the settled answer; an unsettled configuration is refused
    assert make_engine(comm, gemma, settle_run(comm, gemma, RunConfig(), DecodeConfig())
                       ).model.kv_dtype == mx.float32
    with pytest.raises(ValueError, match="settle_run"):
        make_engine(comm, gemma, RunConfig())
