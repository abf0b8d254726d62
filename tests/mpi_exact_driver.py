"""Runs many CP configurations in one MPI launch (loading the model once), for the tests.

    mpiexec -n N python tests/mpi_exact_driver.py MODEL CONFIGS_JSON OUT_JSON [DEVICE [no-weight-cache]]

Each config: {"algo", "chunk", "length", "decode", "seed"[, "score": true, "merge":
"allgather", "interleave": 1, "tp": "off", "comm": "mpi"]}. For each,
rank 0 records the logprob of every prompt token (when scoring), the greedy
continuation, and per-rank KV bytes, prefill communication bytes and peak memory beyond
the weights. ``DEVICE``: the compute path, as ``--device`` (default auto);
``no-weight-cache``: a GGUF's weights converted afresh, as ``--no-weight-cache``.
"""

import json
import sys

from spmd_cp.blas import ensure_fast_blas

if __name__ == "__main__":
    # As the CLI does: re-exec with an optimized BLAS before MPI_Init, and before the
    # heavy imports below, which the re-executed process would otherwise pay twice.
    ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from spmd_cp.config import DecodeConfig  # noqa: E402
from spmd_cp.engine.cache.cache import NO_REWIND  # noqa: E402
from spmd_cp.engine.engine import Engine  # noqa: E402
from spmd_cp.engine.generation import decode_tokens  # noqa: E402
from spmd_cp.models.loader import load_model  # noqa: E402
from spmd_cp.engine.model import CPModel  # noqa: E402
from spmd_cp.models.quantized_shadows import SHADOWS  # noqa: E402


def prompt_ids(length: int, seed: int, vocab: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, min(vocab, 20000), size=length)


def run_config(comm, model, config, model_bytes):
    mx.clear_cache()
    mx.reset_peak_memory()
    decode = DecodeConfig(kv_interleave=config.get("interleave", 1),
                          decode_merge=config.get("merge", "allgather"),
                          decode_tp=config.get("tp", "off"), decode_comm=config.get("comm", "mpi"),
                          decode_step=config.get("step", "auto"))
    engine = Engine(model, comm, algo=config["algo"], prefill_chunk=config["chunk"],
                    decode=decode)
    cache = engine.new_cache()
    if config.get("trim"):  # as generate's: sliding-window layers drop what no query sees
        cache.rewinds_to = NO_REWIND
    ids = prompt_ids(config["length"], config["seed"], 49152)
    bytes_before = comm.bytes_sent
    window_before = (comm.window_kv_bytes, comm.window_kv_ring_bytes)
    logits, records = engine.prefill(cache, ids, score=config.get("score", True))
    prefill_bytes = comm.bytes_sent - bytes_before
    window_bytes = (comm.window_kv_bytes - window_before[0],
                    comm.window_kv_ring_bytes - window_before[1])
    peak_beyond_weights = comm.allgather_object(mx.get_peak_memory() - model_bytes)
    kv_after_prefill = comm.allgather_object(cache.nbytes)
    tokens = [token for token, _ in decode_tokens(engine, cache, logits, mx.argmax,
                                                  config["decode"])]
    if tokens:
        # Cache every greedy token, the last too: the tests count decode placement on
        # shard sizes of length + decode tokens.
        engine.decode_step(cache, tokens[-1])
    comm_bytes = comm.allgather_object(prefill_bytes)
    return {
        "config": config,
        "ids": ids.tolist(),
        "logprob": records.logprob if records else None,
        "pos": records.pos if records else None,
        "greedy": tokens,
        "algos": sorted(set(engine.algos_used)),
        "tp_used": engine.plan is not None and engine.plan.layout == "split",
        "decode_plan": engine.plan.as_dict() if engine.plan is not None else None,
        "kv_bytes_prefill": kv_after_prefill,
        "kv_bytes_final": comm.allgather_object(cache.nbytes),
        "shard_sizes": cache.shard_sizes,
        "prefill_comm_bytes": comm_bytes,
        # pass-KV's bytes for sliding-window layers, and a full ring's for them, per rank
        "window_kv_bytes": comm.allgather_object(window_bytes),
        "peak_beyond_weights": peak_beyond_weights,
    }


def main(comm, _options):
    from mlx.utils import tree_flatten

    from spmd_cp.runtime.device import Compute

    model_path, configs_json, out_path = sys.argv[1:4]
    compute = Compute.resolve(sys.argv[4] if len(sys.argv) > 4 else "auto")
    # "no-weight-cache": convert a GGUF's weights afresh (--no-weight-cache), so that a
    # cached copy of an earlier run's cannot hide the conversion under test
    weight_cache = "no-weight-cache" not in sys.argv[5:]
    loaded = load_model(model_path, weight_cache=weight_cache).model
    # the weights held: the parameters and the packed forms decode reads (a quantized
    # GGUF's shadows, models/quantized_shadows.py)
    model_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.parameters())) + SHADOWS.nbytes
    model = CPModel(loaded, compute=compute)
    results = [run_config(comm, model, c, model_bytes) for c in json.loads(configs_json)]
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    from spmd_cp.runtime import spmd

    # As every command runs: a watchdog bounds each blocking call, and any rank's
    # failure prints its traceback and aborts the whole job non-zero.
    sys.exit(spmd.run_main(main, {}))
