"""Native decode steps (engine/native_decode.py) against mlx-lm's own forward pass.

    mpiexec -n N python tests/native_decode_driver.py OUT_JSON [--graph] MODEL [MODEL ...]

For each model and each decode mode (one rank: replicated; several: the split step and
the replicated one, and for the first model the split step with blocking collectives in
place of persistent ones), a random prompt is prefilled, then fixed random tokens are fed one
decode step at a time; rank 0 keeps every step's logits; then the same on a fresh cache
with the same engine (a second conversation). The reference is mlx-lm's
unmodified model over the whole sequence at once (no cache, float32 weights as loaded).
``--graph``: MLX's step (``--decode-step graph``) in place of the native one.
Writes {"ranks", "results": [{"model", "tp", "persistent", "decode_step", "error",
"argmax_equal"}]}.
"""

import json
import sys

import numpy as np

PROMPT, STEPS = 40, 6


def run(comm, model_path: str, loaded, tp: str, persistent: bool = True,
        step: str = "auto") -> dict:
    from spmd_cp.config import DecodeConfig
    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.model import CPModel

    rng = np.random.default_rng(7)
    ids = rng.integers(3, 2000, size=PROMPT + STEPS)
    # blocking: the collectives a library without persistent ones (MPI 3) gets
    decode = DecodeConfig(decode_tp=tp, decode_step=step,
                          decode_requests="persistent" if persistent else "blocking")
    engine = Engine(CPModel(loaded), comm, algo="pass-kv", decode=decode)
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, ids[:PROMPT])
    plan = engine.prepare_decode()
    assert plan.layout == ("split" if tp == "on" else "replicated"), plan
    # the first conversation, then a second one on a fresh cache with the same engine
    # (its native step re-reads the new cache's buffers): both against mlx-lm
    first = decode_against_reference(engine, cache, logits, ids, loaded)
    other = np.random.default_rng(8).integers(3, 2000, size=PROMPT + STEPS)
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, other[:PROMPT])
    second = decode_against_reference(engine, cache, logits, other, loaded)
    if comm.rank != 0:
        return {}
    return {"model": model_path, "tp": tp, "persistent": persistent,
            "decode_step": engine.decode_modes["decode_step"], "requests": plan.requests,
            "error": max(first[0], second[0]), "argmax_equal": first[1] and second[1]}


def decode_against_reference(engine, cache, logits, ids, loaded):
    """Feed ids[PROMPT:-1] one decode step at a time after the prefill's ``logits``:
    (the largest error relative to the largest logit, whether every argmax agrees)
    against mlx-lm's forward over the whole sequence, on rank 0 (None elsewhere)."""
    import mlx.core as mx

    steps = [logits]
    for token in ids[PROMPT:-1]:
        steps.append(engine.decode_step(cache, int(token)))
    if engine.comm.rank != 0:
        return None, None
    got = np.stack([np.array(s, np.float64).reshape(-1) for s in steps])
    reference = np.array(loaded(mx.array(ids[:-1])[None])[0].astype(mx.float32), np.float64)
    wanted = reference[PROMPT - 1:]
    error = float(np.abs(got - wanted).max() / np.abs(wanted).max())
    return error, bool((got.argmax(axis=1) == wanted.argmax(axis=1)).all())


def main(comm, _options):
    from spmd_cp.models.loader import load_model

    out_path, *models = sys.argv[1:]
    step = "auto"
    if models[0] == "--graph":
        step, models = "graph", models[1:]
    modes = ["off"] if comm.size == 1 else ["on", "off"]
    results = []
    for path in models:
        loaded = load_model(path).model
        results += [run(comm, path, loaded, tp, step=step) for tp in modes]
        if comm.size > 1 and path == models[0] and step == "auto":
            results.append(run(comm, path, loaded, "on", persistent=False))
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()  # the forward and the BLAS preloaded, as the CLI runs
    from spmd_cp.runtime import spmd

    sys.exit(spmd.run_main(main, {}))
