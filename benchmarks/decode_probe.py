"""Where one rank's decode step spends its time: spmd-cp's step beside mlx-lm's model call.

    mpiexec -n 1 python benchmarks/decode_probe.py --model DIR --contexts 8192 32768

One process loads a model twice, with mlx-lm's loader and with spmd-cp's (``--device``
picks spmd-cp's path; gpu by default), prefills the same random prompt of each context
length into each one's own cache, then times --steps decode steps of each, three ways:

- ``build_ms``: the host building the step's graph (Python: mlx-lm's ``model(y,
  cache=...)``, spmd-cp's ``Engine.decode_step(..., wait=False)``), nothing evaluated;
- ``eval_ms``: ``mx.eval`` of a step already built (MLX encoding its kernels, and the
  device running them);
- ``step_ms``: the two back to back, as a lock-step loop runs them.

Medians over the steps. A gap in ``build_ms`` is the host's Python; one in ``eval_ms``
the graph's kernels (or their encoding). The decode loops overlap the next step's build
with this one's eval (mlx-lm's generate_step, spmd-cp's one-rank loop), so a step costs
about the larger of the two there. ``benchmarks/gpu_check.py`` runs this on a GPU; the
test suite runs it on the CPU at tiny sizes (``tests/test_gpu_check.py``). Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np


def timed_steps(build, steps: int) -> dict:
    """Medians of building, evaluating, and both, over ``steps`` decode steps."""
    build_s, eval_s, step_s = [], [], []
    for _ in range(steps):
        mx.synchronize()
        start = time.perf_counter()
        out = build()
        built = time.perf_counter()
        mx.eval(out)  # returns once the step is computed
        done = time.perf_counter()
        build_s.append(built - start)
        eval_s.append(done - built)
        step_s.append(done - start)
    return {name: round(statistics.median(values) * 1e3, 4)
            for name, values in (("build_ms", build_s), ("eval_ms", eval_s),
                                 ("step_ms", step_s))}


def warm_timed_steps(build, steps: int) -> dict:
    """``timed_steps`` after three steps that compile this shape's kernels."""
    timed_steps(build, 3)
    return timed_steps(build, steps)


def mlx_lm_steps(model_path: str, prompt: np.ndarray, steps: int) -> dict:
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(model_path)
    cache = make_prompt_cache(model)
    for begin in range(0, prompt.size, 2048):  # mlx-lm's prefill step
        model(mx.array(prompt[begin:begin + 2048])[None], cache=cache)
        mx.eval([c.state for c in cache])
    token = mx.array([[int(prompt[-1])]])
    result = warm_timed_steps(lambda: model(token, cache=cache), steps)
    del model, cache
    mx.clear_cache()
    return result


def spmd_cp_steps(model_path: str, prompt: np.ndarray, steps: int, device: str) -> dict:
    from mpi4py import MPI

    from spmd_cp.run.builder import make_engine, settle_run
    from spmd_cp.config import RunConfig
    from spmd_cp.models.loader import load_model
    from spmd_cp.runtime.comm import Comm

    comm = Comm(MPI.COMM_WORLD)
    run = RunConfig(model_path=model_path, keep_quantized=True, device=device)
    loaded = load_model(model_path, keep_quantized=True)
    run = settle_run(comm, loaded, run)
    engine = make_engine(comm, loaded, run)
    cache = engine.new_cache()
    engine.prefill(cache, prompt)
    engine.prepare_decode()
    token = mx.array(int(prompt[-1]))  # lazy, as the overlapped one-rank loop feeds it
    result = warm_timed_steps(lambda: engine.decode_step(cache, token, wait=False), steps)
    result["decode_step"] = engine.plan.step
    del engine, cache, loaded
    mx.clear_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="gpu",
                        help="spmd-cp's --device")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for context in args.contexts:
        prompt = rng.integers(3, 20000, context)
        rows.append({"context": context,
                     "mlx-lm": mlx_lm_steps(args.model, prompt, args.steps),
                     "spmd-cp": spmd_cp_steps(args.model, prompt, args.steps, args.device)})
    print(json.dumps({"decode_probe": rows, "device": str(mx.default_device())}))


if __name__ == "__main__":
    main()
