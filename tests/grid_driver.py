"""Runs models through a CP x TP grid (``--tp``) under every CP algorithm in one launch.

    mpiexec -n N python tests/grid_driver.py MODELS_JSON TP ALGOS OUT_JSON

MODELS_JSON: {name: [model path, prompt length]}; ALGOS: comma-separated ``--cp-algo``s.
Per model and algorithm, rank 0 records the logprob of every prompt token (a float32
cache) and the greedy continuation; per model, every rank's weight bytes, the most MLX
memory it held while loading, and its KV heads.
The grid, the load of each rank's slices and the decode settings are the CLI's own
(run/builder.load_checked_model's and make_engine's).
"""

import json
import sys

from spmd_cp.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas()  # as the CLI does, before MPI_Init and the heavy imports

from spmd_cp.run.metrics import model_nbytes  # noqa: E402
from spmd_cp.config import DecodeConfig  # noqa: E402
from spmd_cp.engine.engine import Engine  # noqa: E402
from spmd_cp.engine.generation import decode_tokens  # noqa: E402
from spmd_cp.engine.weights.sharded_model import build_cp_model  # noqa: E402
from spmd_cp.engine.weights.tensor_load import load_tensor_share  # noqa: E402
from spmd_cp.models.loader import load_model  # noqa: E402
from spmd_cp.runtime.grid import Grid  # noqa: E402

# the prompts and continuation length test_families' mlx-lm reference takes
from families_driver import DECODE, prompt_ids  # noqa: E402

SEED = 7


def run_model(comm, tp: int, algos: list[str], path: str, length: int) -> dict:
    import mlx.core as mx

    grid = Grid.of(comm, tp)
    mx.reset_peak_memory()
    if grid.tp:  # each rank reads its slices, as the CLI's load does
        loaded = load_tensor_share(path, grid.tp.rank, tp)
    else:
        loaded = load_model(path, packed_decode=False)
    model = build_cp_model(loaded, comm, "float32", None, grid.tp,
                           getattr(loaded, "vocab_rows", None))
    decode = DecodeConfig() if grid.tp else DecodeConfig(decode_tp="off")
    out = {"weights": comm.gather_object(model_nbytes(loaded.model)),
           "load_peak": comm.gather_object(mx.get_peak_memory()),
           "kv_heads": comm.gather_object(model.num_kv_heads), "algos": {}}
    for algo in algos:
        engine = Engine(model, comm, algo=algo, decode=decode, grid=grid)
        cache = engine.new_cache()
        logits, records = engine.prefill(cache, prompt_ids(length, SEED), score=True)
        tokens = [t for t, _ in decode_tokens(engine, cache, logits, mx.argmax, DECODE)]
        out["algos"][algo] = {"logprob": records.logprob if records else None,
                              "greedy": tokens, "step": engine.decode_modes["decode_step"]}
    return out


def main(comm, _options):
    models, tp, algos, out_path = sys.argv[1:5]
    results = {name: run_model(comm, int(tp), algos.split(","), path, length)
               for name, (path, length) in json.loads(models).items()}
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    from spmd_cp.runtime import spmd

    sys.exit(spmd.run_main(main, {}))
