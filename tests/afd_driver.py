"""Runs models with attention and FFN ranks apart (``--afd A:F``) under every CP algorithm
in one launch.

    mpiexec -n N python tests/afd_driver.py MODELS_JSON A:F ALGOS MICRO_BATCHES OUT_JSON

MODELS_JSON: {name: [model path, prompt length]}; ALGOS: comma-separated ``--cp-algo``s.
Per model and algorithm, rank 0 records the logprob of every prompt token (a float32
cache) and the greedy continuation; per model, every rank's weight bytes and the most MLX
memory it held while loading (and the whole model's bytes, its experts' and its largest
layer's), and per algorithm the KV bytes and the AFD summary (bytes crossed,
waits). The load and the engine are the CLI's own
(engine/afd/afd_load.py, engine/afd/afd_engine.py).
"""

import json
import sys

from spmd_cp.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas()  # as the CLI does, before MPI_Init and the heavy imports

from spmd_cp.run.metrics import model_nbytes, rank_metrics  # noqa: E402
from spmd_cp.config import DecodeConfig, RunConfig  # noqa: E402
from spmd_cp.engine.afd.afd_attention import is_mixture  # noqa: E402
from spmd_cp.engine.afd.afd_engine import open_afd_engine  # noqa: E402
from spmd_cp.engine.weights.expert_slices import expert_bytes  # noqa: E402
from spmd_cp.engine.layer_parts import feed_forward  # noqa: E402
from spmd_cp.models.loader import load_model  # noqa: E402
from spmd_cp.engine.afd.afd_load import load_afd_share  # noqa: E402
from spmd_cp.engine.generation import decode_tokens  # noqa: E402
from spmd_cp.runtime.afd import AfdRoles  # noqa: E402
from spmd_cp.runtime.device import Compute  # noqa: E402

# the prompts and continuation length test_families' mlx-lm reference takes
from families_driver import DECODE, prompt_ids  # noqa: E402

SEED = 7


def run_model(comm, spec: str, algos: list[str], micro: int, path: str, length: int) -> dict:
    import mlx.core as mx

    mx.reset_peak_memory()
    loaded = load_afd_share(path, AfdRoles.of(spec, comm.size), comm.rank)
    out = {"weights": comm.gather_object(model_nbytes(loaded.model)),
           "load_peak": comm.gather_object(mx.get_peak_memory()), "algos": {}}
    if comm.rank == 0:  # the whole model, and of it the experts' matrices
        whole = load_model(path, packed_decode=False).model
        mixtures = [layer for layer in whole.model.layers if is_mixture(feed_forward(layer))]
        out["whole"] = model_nbytes(whole)
        out["largest_layer"] = max(model_nbytes(layer) for layer in whole.model.layers)
        out["experts"] = sum(expert_bytes(feed_forward(layer)) for layer in mixtures)
    for algo in algos:
        run = RunConfig(afd=spec, afd_micro_batches=micro, kv_dtype="float32", cp_algo=algo,
                        prefill_chunk=0)
        engine = open_afd_engine(comm, loaded, run, DecodeConfig(), Compute.resolve())
        cache = engine.new_cache()
        logits, records = engine.prefill(cache, prompt_ids(length, SEED), score=True)
        tokens = [t for t, _ in decode_tokens(engine, cache, logits, mx.argmax, DECODE)]
        metrics = rank_metrics(comm, cache, model_nbytes(loaded.model), engine.grid)
        out["algos"][algo] = {"logprob": records.logprob if records else None,
                              "greedy": tokens, "step": engine.decode_modes["decode_step"],
                              "kv_cache_bytes": metrics.get("kv_cache_bytes"),
                              "afd": metrics.get("afd")}
    return out


def main(comm, _options):
    models, spec, algos, micro, out_path = sys.argv[1:6]
    results = {name: run_model(comm, spec, algos.split(","), int(micro), path, length)
               for name, (path, length) in json.loads(models).items()}
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    from spmd_cp.runtime import spmd

    sys.exit(spmd.run_main(main, {}))
