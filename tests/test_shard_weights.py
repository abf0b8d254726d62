"""--shard-weights: each rank holds its layers (i mod N) and 1/N of the vocabulary, and
the results equal the replicated run's.

References: the replicated run at the same N (the same math: equal tokens and argmaxes,
log-probs equal up to float32 rounding), the single-rank replicated run (the suite's CP
tolerance), ``mx.load`` for the GGUF reader, the loaded model's own byte count for the
layout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
# The same math at the same N is not always bitwise the same: OpenBLAS on an AMD EPYC
# summed one of 80 rows of a sliced LM head 1 ulp apart from the whole head's product.
ROUNDING = dict(rtol=1e-6, atol=0)
NO_WEIGHT_CACHE = ["--no-weight-cache"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("shard") / "text.txt"
    path.write_text(" ".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(9)))
    return str(path)


def score(n, model, text_file, tmp_path, *flags):
    out = tmp_path / f"score-{n}-{len(list(tmp_path.iterdir()))}.jsonl"
    launch = run_cli(n, ["score", "--model", model, "--text-file", text_file, "--output",
                         str(out), "--json", *NO_WEIGHT_CACHE, *flags])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return launch.last_json(), rows


def generate(n, model, text_file, *flags, check=True):
    return run_cli(n, ["generate", "--model", model, "--prompt-file", text_file,
                       "--no-chat-template", "--max-tokens", "6", "--json", *NO_WEIGHT_CACHE,
                       *flags], check=check)


@pytest.mark.parametrize("kind, n", [("llama", 2), ("qwen3", 3)])  # tied, untied LM head
def test_sharded_score_equals_replicated(tiny_models, text_file, tmp_path, kind, n):
    model = tiny_models[kind]
    _, single = score(1, model, text_file, tmp_path)
    plain, replicated = score(n, model, text_file, tmp_path, "--shard-weights", "off")
    trace = tmp_path / "trace.json"
    summary, sharded = score(n, model, text_file, tmp_path, "--shard-weights", "on",
                             "--trace", str(trace))
    drop_logprob = lambda rows: [{k: v for k, v in r.items() if k != "logprob"}  # noqa: E731
                                 for r in rows]
    assert drop_logprob(sharded) == drop_logprob(replicated)
    np.testing.assert_allclose([r["logprob"] for r in sharded],
                               [r["logprob"] for r in replicated], **ROUNDING)
    assert [r["pos"] for r in sharded] == [r["pos"] for r in single]
    np.testing.assert_allclose([r["logprob"] for r in sharded],
                               [r["logprob"] for r in single], **TOLERANCE)
    # Every rank owns a layer and broadcast it: each sent more than attention alone.
    assert all(s > p for s, p in zip(summary["comm_bytes"], plain["comm_bytes"]))
    assert max(summary["model_bytes"]) < min(plain["model_bytes"])
    # --trace shows every layer's broadcast, on every rank.
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    prefetched = {(e["pid"], e["name"]) for e in events if e["name"].startswith("prefetch")}
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    assert prefetched == {(r, f"prefetch layer {i}") for r in range(n) for i in range(layers)}


def test_sharded_greedy_generation_equals_one_rank(tiny_models, text_file):
    model = tiny_models["llama"]
    expected = generate(1, model, text_file).last_json()
    # Several prefill chunks: the store's passes follow each other (and prefetch across).
    for n, chunk in ((2, "0"), (3, "0"), (2, "40")):
        got = generate(n, model, text_file, "--shard-weights", "on", "--prefill-chunk",
                       chunk).last_json()
        assert got["text"] == expected["text"] and got["tokens"] == expected["tokens"], n


def layer_and_total_bytes(model: str) -> tuple[int, int]:
    from spmd_cp.models.partial_load import weight_layout

    layout = weight_layout(model)
    return max(layout.layers_compute), layout.replicated


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny model with a 403 MB embedding: weights large against the rank process's
    own resident memory (about 150-200 MB), which the memory limit also counts."""
    from conftest import write_tiny_model

    wide = {"hidden_size": 2048, "head_dim": 16}  # q/k/v/o stay small: 8 heads of 16
    return str(write_tiny_model(tmp_path_factory.mktemp("wide") / "llama", "llama", 3, wide))


def test_memory_limit_shards_automatically_and_bounds_model_bytes(wide_model, text_file):
    from spmd_cp.engine.weights.weights import PREFETCH_LAYERS

    model = wide_model
    layer, replicated = layer_and_total_bytes(model)
    norm = 4 * 2048
    expected = generate(1, model, text_file).last_json()
    assert expected["model_bytes"] == [replicated]
    # The limit counts resident memory: the process's own part (interpreter, libraries,
    # tokenizer) as one rank measured it, and 3/4 of the weights.
    process = expected["memory_forecast"]["process_bytes"]
    assert 0 < process < expected["resident_peak_bytes"][0]
    limit = ["--memory-limit", str(int(process + replicated * 0.75))]
    refused = generate(1, model, text_file, *limit, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "--shard-weights on at 2 ranks" in refused.stderr
    for n in (2, 3, 4):
        got = generate(n, model, text_file, *limit).last_json()  # --shard-weights auto
        assert got["text"] == expected["text"], n
        # 1/N of the vocabulary, whole layers (3 of them: at N = 4 one rank owns none and
        # the others one, more than 3/4 of a layer), the window of K + 1 layers, and the
        # final norm (one vector, which every rank keeps whole).
        layers = 3
        bound = ((replicated - layers * layer) / n + math.ceil(layers / n) * layer
                 + (PREFETCH_LAYERS + 1) * layer + norm)
        assert all(b <= bound for b in got["model_bytes"]), (n, got["model_bytes"], bound)
        assert max(got["model_bytes"]) < replicated


@pytest.mark.parametrize("kind, n", [("llama", 2), ("qwen3", 3)])  # tied, untied LM head
def test_split_decode_from_sharded_weights_equals_one_rank(tiny_models, text_file, kind, n):
    """--shard-weights on --decode-tp on: each rank cuts its slices while the store
    broadcasts every layer once, then decodes without broadcasting layers. The tokens are
    one rank's; it sends far less than sharded replicated decode (which is what
    --decode-tp auto keeps with sharded weights), and its model_bytes count the slices."""
    model = tiny_models[kind]
    longer = ("--max-tokens", "24")  # decode's traffic, not prefill's, dominates comm_bytes
    expected = generate(1, model, text_file, *longer).last_json()
    split = generate(n, model, text_file, "--shard-weights", "on", "--decode-tp", "on", *longer)
    replicated = generate(n, model, text_file, "--shard-weights", "on", *longer)
    got, plain = split.last_json(), replicated.last_json()
    assert got["token_ids"] == expected["token_ids"] == plain["token_ids"]
    assert (got["decode_tp"], plain["decode_tp"]) == ("on", "off")
    assert "from the layer-sharded store" in split.stderr
    assert "decode plan: replicated layout (layer-sharded weights" in replicated.stderr
    assert sum(got["comm_bytes"]) < sum(plain["comm_bytes"]) / 2
    assert all(g > p for g, p in zip(got["model_bytes"], plain["model_bytes"]))


def test_gguf_reader_equals_mx_load(embedded_model):
    import mlx.core as mx

    from spmd_cp.models.gguf import _mlx_name
    from spmd_cp.models.tensor_files import GGUFFile

    reference = mx.load(embedded_model)
    gguf = GGUFFile(embedded_model)
    for gguf_name in ("blk.0.attn_q.weight", "token_embd.weight", "blk.29.ffn_down.weight",
                      "output_norm.weight"):
        ref = reference[gguf_name]
        rows = (5, 77) if ref.ndim == 2 else None
        got = gguf.read(_mlx_name(gguf_name), rows=rows)
        base = gguf_name[: -len(".weight")]
        for name, array in got.items():
            want = reference[f"{base}.{name.rsplit('.', 1)[1]}"]
            want = want[5:77] if rows else want.astype(mx.float32)
            assert array.dtype == want.dtype and array.shape == want.shape, name
            assert np.array_equal(np.array(array), np.array(want)), name


def test_rank_share_reads_only_its_share(tiny_models):
    """A rank's peak MLX memory while loading stays near its share, and the layout
    counts what the replicated loader holds."""
    from mlx.utils import tree_flatten

    from spmd_cp.models.loader import load_model

    model = tiny_models["qwen3"]
    layer, replicated = layer_and_total_bytes(model)
    loaded = load_model(model)
    assert replicated == sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()))
    code = ("import mlx.core as mx; from spmd_cp.models.partial_load import load_rank_share; "
            f"s = load_rank_share({model!r}, 1, 3).share; "
            "print(mx.get_peak_memory(), sorted(s.layers), s.vocab_rows)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    assert int(out[0]) <= replicated / 3 + layer
    assert out[1].strip() == "[1] (16384, 32768)"


def test_doctor_reports_the_sharded_layout_the_run_holds(tiny_models, text_file, tmp_path):
    """doctor's weight figures, from the file headers, against real runs: replicated equals
    one rank's loaded model_bytes; sharded bounds what each rank of a sharded run held."""
    model = tiny_models["qwen3"]
    launch = run_cli(2, ["doctor", "--model", model, "--json", *NO_WEIGHT_CACHE],
                     env={"SPMD_CP_CACHE": str(tmp_path)}, timeout=120)
    weights = launch.last_json()["weights"]
    replicated = generate(1, model, text_file).last_json()["model_bytes"][0]
    assert weights["replicated_bytes"] == replicated
    sharded = generate(2, model, text_file, "--shard-weights", "on").last_json()["model_bytes"]
    assert max(sharded) <= weights["sharded_bytes"] < replicated
    assert weights["auto_shards"] is False  # a tiny model fits the default limit
    assert "--shard-weights on:" in launch.stdout and "keeps them replicated" in launch.stdout


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Layers heavier than the vocabulary: 12 layers of 7 MB (float32) against 50 MB."""
    from conftest import write_tiny_model

    deep = {"hidden_size": 256, "head_dim": 32, "intermediate_size": 2048,
            "num_hidden_layers": 12}
    return str(write_tiny_model(tmp_path_factory.mktemp("deep") / "llama", "llama", 5, deep))


def test_replicated_decode_over_sharded_layers_holds_a_window_not_the_model(deep_model,
                                                                          text_file):
    """Decode steps over a layer store keep MPI's collectives (`--decode-comm auto`): a
    step built as one MLX graph would hold every layer received for it until evaluated
    (with SmolLM2 in float32 at N = 2: MLX peak 471 vs 282 MiB). MLX's peak per rank
    stays within its own layers, the window, 1/N of the vocabulary and a few MB of
    activations; the tokens are the replicated run's."""
    from spmd_cp.engine.weights.weights import PREFETCH_LAYERS

    layer, replicated = layer_and_total_bytes(deep_model)
    expected = generate(2, deep_model, text_file, "--shard-weights", "off").last_json()
    got = generate(2, deep_model, text_file, "--shard-weights", "on").last_json()
    assert got["token_ids"] == expected["token_ids"]
    assert got["decode_comm"] == "mpi"
    layers = 12
    vocab_share = (replicated - layers * layer) / 2
    bound = vocab_share + (layers // 2 + PREFETCH_LAYERS + 1) * layer + 8 * 2**20
    assert bound < vocab_share + layers * layer  # every layer at once would break it
    assert max(got["peak_mem_bytes"]) <= bound, (got["peak_mem_bytes"], bound)
