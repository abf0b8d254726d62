"""Native decode steps (engine/decode/native_decode.py) against mlx-lm's own forward pass.

    mpiexec -n N python tests/native_decode_driver.py OUT_JSON [--graph] MODEL [MODEL ...]

For each model and each decode mode (one rank: replicated; several: the split step and
the replicated one, and for the first model the split step with blocking collectives in
place of persistent ones, and each decode mode over a float16 and a bfloat16 KV cache), a random prompt is prefilled, then fixed random tokens are fed one
decode step at a time; rank 0 keeps every step's logits; then the same on a fresh cache
with the same engine (a second conversation). The reference is mlx-lm's
unmodified model over the whole sequence at once (float32 weights as loaded; with a
half-precision cache, mlx-lm's own KVCache holding float16 or bfloat16 keys and values,
read back into float32 for attention, as spmd-cp's CPU path reads its cache).
``--graph``: MLX's step (``--decode-step graph``) in place of the native one.
Writes {"ranks", "results": [{"model", "tp", "persistent", "kv_dtype", "decode_step",
"requests", "error", "argmax_equal"}]}.
"""

import json
import sys

import numpy as np

PROMPT, STEPS = 40, 6


def half_cache(dtype_name: str):
    """mlx-lm's KVCache storing ``dtype_name``, its contents read back in float32."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    dtype = getattr(mx, dtype_name)

    class HalfKVCache(KVCache):
        def update_and_fetch(self, keys, values):
            keys, values = super().update_and_fetch(keys.astype(dtype), values.astype(dtype))
            return keys.astype(mx.float32), values.astype(mx.float32)

    return HalfKVCache


def run(comm, model_path: str, loaded, tp: str, persistent: bool = True,
        kv_dtype: str = "float32", step: str = "auto") -> dict:
    from spmd_cp.config import DecodeConfig
    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.model import CPModel

    rng = np.random.default_rng(7)
    ids = rng.integers(3, 2000, size=PROMPT + STEPS)
    # blocking: the collectives a library without persistent ones (MPI 3) gets
    decode = DecodeConfig(decode_tp=tp, decode_step=step,
                          decode_requests="persistent" if persistent else "blocking")
    engine = Engine(CPModel(loaded, cpu_kv_dtype=kv_dtype), comm, algo="pass-kv", decode=decode)
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, ids[:PROMPT])
    plan = engine.prepare_decode()
    assert plan.layout == ("split" if tp == "on" else "replicated"), plan
    # the first conversation, then a second one on a fresh cache with the same engine
    # (its native step re-reads the new cache's buffers): both against mlx-lm
    first = decode_against_reference(engine, cache, logits, ids, loaded, kv_dtype)
    other = np.random.default_rng(8).integers(3, 2000, size=PROMPT + STEPS)
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, other[:PROMPT])
    second = decode_against_reference(engine, cache, logits, other, loaded, kv_dtype)
    if comm.rank != 0:
        return {}
    return {"model": model_path, "tp": tp, "persistent": persistent, "kv_dtype": kv_dtype,
            "decode_step": engine.decode_modes["decode_step"], "requests": plan.requests,
            "error": max(first[0], second[0]), "argmax_equal": first[1] and second[1]}


def decode_against_reference(engine, cache, logits, ids, loaded, kv_dtype: str):
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
    caches = None
    if kv_dtype != "float32":
        caches = [half_cache(kv_dtype)() for _ in loaded.layers]
    reference = np.array(loaded(mx.array(ids[:-1])[None], cache=caches)[0].astype(mx.float32),
                         np.float64)
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
        if path == models[0] and step == "auto":
            results += [run(comm, path, loaded, tp, kv_dtype=kv)
                        for kv in ("float16", "bfloat16") for tp in modes]
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()  # the forward and the BLAS preloaded, as the CLI runs
    from spmd_cp.runtime import spmd

    sys.exit(spmd.run_main(main, {}))
