"""CP on N real MPI ranks equals mlx-lm's own, unmodified single-process model.

The reference is independent of everything in spmd_cp.attention/engine/model: mlx-lm's
``model(ids)`` for the log-probabilities and mlx-lm's ``generate_step`` (with its own
KV cache) for the greedy continuation.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache

import numpy as np
import pytest

from conftest import TESTS, run_ranks
from mpi_exact_driver import prompt_ids

DRIVER = [sys.executable, str(TESTS / "mpi_exact_driver.py")]
ALGOS = ["allgather-kv", "pass-kv", "pass-q", "auto"]
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def configs_for(n: int, algos: list[str], lengths: list[int], decode: int) -> list[dict]:
    configs = []
    for algo in algos:
        for length in lengths:
            configs.append({"algo": algo, "chunk": 0, "length": length, "decode": decode, "seed": length})
        # Several chunks: later chunks attend to the sharded cache of earlier ones.
        configs.append({"algo": algo, "chunk": 7, "length": 23, "decode": decode, "seed": 5})
    return configs


def lengths_for(n: int) -> list[int]:
    # 1 token; fewer tokens than ranks; 2N+1; an odd length not a multiple of 2N.
    return sorted({1, max(n - 1, 1), 2 * n + 1, 29})


@lru_cache(maxsize=None)
def mlx_lm_reference(model_path: str, length: int, seed: int, decode: int):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = _load(model_path)
    ids = prompt_ids(length, seed, 49152)
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    scored = logprobs[np.arange(length - 1), ids[1:]]
    greedy = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=decode,
                                               sampler=lambda lp: mx.argmax(lp, axis=-1))]
    return scored, greedy


@lru_cache(maxsize=None)
def _load(model_path: str):
    from spmd_cp.models.loader import load_model

    return load_model(model_path).model


def run_driver(n: int, model_path: str, configs: list[dict], tmp_path) -> list[dict]:
    out = tmp_path / f"results-{n}.json"
    run_ranks(n, DRIVER + [model_path, json.dumps(configs), str(out)], timeout=400)
    data = json.loads(out.read_text())
    assert data["ranks"] == n
    return data["results"]


def check_against_reference(results: list[dict], model_path: str, n: int, balance: int = 2):
    for result in results:
        config = result["config"]
        length = config["length"]
        scored, greedy = mlx_lm_reference(model_path, length, config["seed"], config["decode"])
        where = f"N={n} {config}"
        assert result["pos"] == list(range(1, length)), where
        np.testing.assert_allclose(result["logprob"], scored, **TOLERANCE, err_msg=where)
        assert result["greedy"] == greedy, where
        # Balanced shards: every token cached exactly once, sizes within 2 of each other
        # (head-tail gives at most one extra token per rank per prefill call, and decode
        # tokens go to the least loaded rank).
        sizes = result["shard_sizes"]
        assert sum(sizes) == length + config["decode"], where
        assert max(sizes) - min(sizes) <= balance, where


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tiny_gqa_models_match_mlx_lm(n, tiny_models, tmp_path):
    for kind, path in tiny_models.items():
        results = run_driver(n, path, configs_for(n, ALGOS, lengths_for(n), decode=5), tmp_path)
        check_against_reference(results, path, n)


# The embedded model's launches at N = 1 and 4 serve three tests (one model load per
# rank count): the memory measurement first, in a process that has run nothing else.
MEMORY_CONFIG = {"algo": "pass-kv", "chunk": 0, "length": 1024, "decode": 0, "seed": 2,
                 "score": False}
KV_CONFIG = {"algo": "auto", "chunk": 0, "length": 203, "decode": 0, "seed": 1, "score": False}


def smollm2_configs(n: int) -> list[dict]:
    # Every algorithm on a full prompt and on several chunks (later chunks attend to a
    # cached prefix: auto picks pass-q there); the short edge cases with the default.
    configs = [{"algo": algo, "chunk": chunk, "length": 41, "decode": 3, "seed": 41}
               for algo in ALGOS for chunk in (0, 12)]
    return configs + [{"algo": "auto", "chunk": 0, "length": length, "decode": 3,
                       "seed": length} for length in sorted({1, max(n - 1, 1), 2 * n + 1})]


@pytest.fixture(scope="module")
def embedded_runs(embedded_model, tmp_path_factory):
    """``runs(n)``: the driver's results on the embedded model at N = n, launched once."""
    done = {}

    def runs(n: int) -> list[dict]:
        if n not in done:
            shared = [MEMORY_CONFIG, KV_CONFIG] if n in (1, 4) else []
            done[n] = run_driver(n, embedded_model, shared + smollm2_configs(n),
                                 tmp_path_factory.mktemp(f"embedded-{n}"))
        return done[n]
    return runs


def result_of(results: list[dict], config: dict) -> dict:
    (result,) = [r for r in results if r["config"] == config]
    return result


@pytest.mark.parametrize("n", [1, 2, 4])  # N = 3: the tiny models' test above
def test_embedded_smollm2_matches_mlx_lm(n, embedded_model, embedded_runs):
    configs = smollm2_configs(n)
    results = [r for r in embedded_runs(n) if r["config"] in configs]
    assert len(results) == len(configs)
    check_against_reference(results, embedded_model, n)


def test_kv_bytes_split_evenly(embedded_runs):
    """Each of 4 ranks caches about a quarter of the single-rank KV bytes."""
    single = result_of(embedded_runs(1), KV_CONFIG)["kv_bytes_prefill"][0]
    split = result_of(embedded_runs(4), KV_CONFIG)["kv_bytes_prefill"]
    assert sum(split) == single
    # SmolLM2: 30 layers x 2 x 3 KV heads x 64 x 4 bytes = 46,080 bytes per token.
    assert single == 203 * 46080
    for per_rank in split:
        assert abs(per_rank - single / 4) <= 46080, split


# -- communication volumes: counted bytes equal the analytic ones (docs/ALGORITHMS.md) ----
def analytic_prefill_bytes(algo: str, length: int, n: int, dims: dict) -> list[int]:
    """Bytes each rank sends in one un-chunked prefill of ``length`` tokens."""
    from spmd_cp.attention.partition import head_tail_positions, owner_of

    layers, nh, nkv, d, e, vocab = (dims[k] for k in ("L", "NH", "NKV", "d", "e", "V"))
    sizes = [p.size for p in head_tail_positions(length, n)]
    per_rank = []
    for rank in range(n):
        forwarded = [sizes[(rank - step) % n] for step in range(n - 1)]  # ring steps
        others = sum(sizes) - sizes[rank]
        attention = {
            "allgather-kv": (n - 1) * 2 * sizes[rank] * nkv * d * e,
            "pass-kv": sum(forwarded) * 2 * nkv * d * e,
            "pass-q": sum(forwarded) * nh * d * e + others * nh * (d + 1) * e,
        }[algo]
        per_rank.append(layers * attention)
    owner = owner_of(length - 1, head_tail_positions(length, n))
    if owner != 0:
        per_rank[owner] += vocab * 4  # the last position's logits go to rank 0
    return per_rank


def test_counted_bytes_equal_analytic_volumes(tiny_models, tmp_path):
    dims = {"L": 3, "NH": 8, "NKV": 2, "d": 16, "e": 4, "V": 49152}
    configs = [{"algo": algo, "chunk": 0, "length": length, "decode": 0, "seed": 3,
                "score": False}
               for algo in ("allgather-kv", "pass-kv", "pass-q") for length in (2, 37)]
    for n in (3,):
        results = run_driver(n, tiny_models["llama"], configs, tmp_path)
        for result in results:
            config = result["config"]
            expected = analytic_prefill_bytes(config["algo"], config["length"], n, dims)
            assert result["prefill_comm_bytes"] == expected, config


def test_prefill_memory_per_rank_shrinks_with_n(embedded_runs):
    """Peak memory beyond the weights at N=4 is at most 40% of one rank's (pass-kv)."""
    single = result_of(embedded_runs(1), MEMORY_CONFIG)["peak_beyond_weights"][0]
    four = result_of(embedded_runs(4), MEMORY_CONFIG)["peak_beyond_weights"]
    assert max(four) <= 0.4 * single, (four, single)


@pytest.mark.parametrize("n", [2, 3])
def test_decode_merges_tensor_parallel_and_interleaved_placement(n, tiny_models, tmp_path):
    """Both decode merges are exact, with and without the tensor-parallel decode step,
    with decode's collectives in MLX's graph and through MPI, and interleaved placement keeps shards within one run of K tokens of each other
    (vLLM's cp_kv_cache_interleave_size)."""
    configs = [{"algo": "auto", "chunk": 0, "length": 13, "decode": 22, "seed": 13,
                "merge": merge, "interleave": k, "tp": tp, "comm": "mlx" if k == 1 else "mpi"}
               for merge in ("allgather", "allreduce") for k in (1, 4) for tp in ("off", "on")]
    results = run_driver(n, tiny_models["qwen3"], configs, tmp_path)
    for result in results:
        k = result["config"]["interleave"]
        check_against_reference([result], tiny_models["qwen3"], n, balance=k + 1)
    for tiny in ("llama",):  # untied LM head (qwen3 above) and tied embedding (llama)
        tied = run_driver(n, tiny_models[tiny], [{**configs[0], "tp": "on"}], tmp_path)
        check_against_reference(tied, tiny_models[tiny], n)
    for result in results:
        k = result["config"]["interleave"]
        total = sum(result["shard_sizes"])
        for size in result["shard_sizes"]:
            assert abs(size - total / n) <= k, result["shard_sizes"]


@pytest.mark.parametrize("variant", ["qwen2", "mistral", "llama3-rope"])
def test_other_families_match_mlx_lm_with_tensor_parallel_decode(variant, tiny_variant_models,
                                                                 tmp_path):
    """qwen2's q/k/v biases (split by heads in the tensor-parallel decode step), mistral
    and Llama 3 RoPE scaling on 2 ranks, prefill and decode, against mlx-lm's forward."""
    path = tiny_variant_models[variant]
    configs = [{"algo": algo, "chunk": chunk, "length": 23, "decode": 6, "seed": 23, "tp": tp}
               for algo, chunk in (("pass-kv", 0), ("pass-q", 7)) for tp in ("off", "on")]
    results = run_driver(2, path, configs, tmp_path)
    assert [r["tp_used"] for r in results] == [c["tp"] == "on" for c in configs]
    check_against_reference(results, path, 2)
