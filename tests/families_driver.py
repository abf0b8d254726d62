"""Runs every model family of the tests through every CP algorithm in one MPI launch.

    mpiexec -n N python tests/families_driver.py MODELS_JSON OUT_JSON CACHE_DIR

MODELS_JSON: {family: model directory}. Per family, rank 0 records for each
``--cp-algo``: the logprob of every prompt token and the greedy continuation of a whole
prefill and of a chunked one; a prompt cache saved after part of the prompt, loaded
back and continued to the end (its continuation); and at N > 1 the split decode step
(``--decode-tp on``): its continuation and whether the split ran, over the replicated
weights and over layer-sharded ones (``--shard-weights``: each rank loads its share).
Every decode step records which step ran it (native or MLX's graph).
"""

import json
import sys

from spmd_cp.blas import ensure_fast_blas

if __name__ == "__main__":
    # As the CLI does: re-exec with an optimized BLAS before MPI_Init, and before the
    # heavy imports below, which the re-executed process would otherwise pay twice.
    ensure_fast_blas()

import numpy as np  # noqa: E402

from spmd_cp.config import DecodeConfig  # noqa: E402
from spmd_cp.engine.engine import Engine  # noqa: E402
from spmd_cp.engine.generation import decode_tokens  # noqa: E402
from spmd_cp.engine.model import CPModel  # noqa: E402
from spmd_cp.engine.cache.prompt_cache import load_cache, read_meta, save_cache  # noqa: E402
from spmd_cp.models.loader import load_model  # noqa: E402

ALGOS = ["allgather-kv", "pass-kv", "pass-q", "auto"]
LENGTH, CHUNK, DECODE, CACHED = 29, 7, 4, 17  # CACHED: prompt tokens the saved cache holds
TP_LENGTH = 23


def prompt_ids(length: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, 20000, size=length)


def greedy(engine, cache, logits) -> list[int]:
    import mlx.core as mx

    return [token for token, _ in decode_tokens(engine, cache, logits, mx.argmax, DECODE)]


def run_algo(comm, model, algo: str, chunk: int) -> dict:
    engine = Engine(model, comm, algo=algo, prefill_chunk=chunk, decode=DecodeConfig(decode_tp="off"))
    cache = engine.new_cache()
    logits, records = engine.prefill(cache, prompt_ids(LENGTH, 1), score=True)
    tokens = greedy(engine, cache, logits)
    return {"logprob": records.logprob if records else None, "greedy": tokens,
            "decode_step": engine.decode_modes["decode_step"]}


def run_saved_cache(comm, model, checksum: str, directory: str) -> list[int]:
    """Prefill part of the prompt, save the cache, load it into a new engine, prefill the
    rest and continue greedily."""
    ids = prompt_ids(LENGTH, 1)
    engine = Engine(model, comm, algo="pass-kv", decode=DecodeConfig(decode_tp="off"))
    cache = engine.new_cache()
    engine.prefill(cache, ids[:CACHED])
    save_cache(comm, cache, directory, checksum,
               conversation={"messages": [], "text": ""})  # what generate saves first
    meta = comm.bcast_object(read_meta(directory) if comm.rank == 0 else None)
    again = Engine(model, comm, algo="pass-q", decode=DecodeConfig(decode_tp="off"))
    loaded = load_cache(comm, directory, meta, checksum, model.num_layers, model.kv_dtype)
    logits, _ = again.prefill(loaded, ids[CACHED:])
    return greedy(again, loaded, logits)


def run_split_decode(comm, model) -> dict:
    engine = Engine(model, comm, algo="pass-kv", decode=DecodeConfig(decode_tp="on"))
    cache = engine.new_cache()
    logits, records = engine.prefill(cache, prompt_ids(TP_LENGTH, 2), score=True)
    tokens = greedy(engine, cache, logits)
    return {"logprob": records.logprob if records else None, "greedy": tokens,
            "tp_used": engine.tp_decoder is not None,
            "decode_step": engine.decode_modes["decode_step"]}


def run_sharded(comm, path: str) -> dict:
    """The split decode step over layer-sharded weights (models/partial_load.py)."""
    from spmd_cp.engine.weights.sharded_model import build_cp_model
    from spmd_cp.models.partial_load import load_rank_share

    share = load_rank_share(path, comm.rank, comm.size)
    return run_split_decode(comm, build_cp_model(share, comm))


def run_family(comm, path: str, cache_dir: str) -> dict:
    loaded = load_model(path)
    model = CPModel(loaded.model)
    out = {"algos": {f"{algo}/{chunk}": run_algo(comm, model, algo, chunk)
                     for algo in ALGOS for chunk in (0, CHUNK)},
           "saved_cache": run_saved_cache(comm, model, loaded.checksum, cache_dir)}
    if comm.size > 1:
        out["split"] = run_split_decode(comm, model)
        out["sharded"] = run_sharded(comm, path)
    return out


def main(comm, _options):
    models_json, out_path, cache_dir = sys.argv[1:4]
    models = json.loads(models_json)
    results = {family: run_family(comm, path, f"{cache_dir}/{family}-{comm.size}")
               for family, path in models.items()}
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    from spmd_cp.runtime import spmd

    sys.exit(spmd.run_main(main, {}))
