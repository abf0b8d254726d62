"""Shared fixtures: real mpiexec launches with timeouts, tiny random models on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
# The console script users run (installed next to this interpreter).
SPMD_CP = [os.path.join(os.path.dirname(sys.executable), "spmd-cp")]

# Oversubscribed ranks on 2 cores: one BLAS thread each, or they fight over cores.
RANK_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Launch:
    def __init__(self, proc: subprocess.CompletedProcess, elapsed: float):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.elapsed = elapsed

    def last_json(self) -> dict:
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        assert lines, f"no stdout; stderr:\n{self.stderr}"
        return json.loads(lines[-1])


def run_ranks(n: int, argv: list[str], timeout: float = 180, env: dict | None = None,
              stdin: str | None = None, check: bool = True) -> Launch:
    """Run ``argv`` on ``n`` real MPI ranks; fail with the ranks' stderr on timeout."""
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    return run_process([MPIEXEC, "-n", str(n), *argv], timeout, env, stdin, check)


def run_process(cmd: list[str], timeout: float = 180, env: dict | None = None,
                stdin: str | None = None, check: bool = True) -> Launch:
    """Run ``cmd`` (a launcher, or a program started without one: an MPI singleton) with
    the ranks' environment; fail with its stderr on timeout."""
    import time

    full_env = {**os.environ, **RANK_ENV, **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s; stderr:\n{err[-5000:]}")
    result = Launch(subprocess.CompletedProcess(cmd, proc.returncode, out, err),
                    time.perf_counter() - start)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {result.returncode}; stderr:\n{err[-5000:]}")
    return result


def run_cli(n: int, args: list[str], **kwargs) -> Launch:
    return run_ranks(n, SPMD_CP + args, **kwargs)


def assert_refused(n: int, args: list[str], message: str) -> Launch:
    """``args`` on ``n`` ranks must be refused as bad input: exit status 2 and ``message``
    in the ranks' stderr."""
    refused = run_cli(n, args, check=False)
    assert refused.returncode == 2, refused.stderr
    assert message in refused.stderr, refused.stderr
    return refused


def _c_helpers_build() -> bool:
    """Whether this machine can build spmd-cp's C helpers (runtime/native.py): a C
    compiler with the C library's headers. Where it cannot, spmd-cp runs without them,
    and the tests of the helpers are skipped, saying so."""
    import tempfile

    from spmd_cp.kernels import gemv_forward
    from spmd_cp.runtime import native

    with tempfile.TemporaryDirectory() as scratch:
        try:
            native.build(gemv_forward.SOURCE, Path(scratch) / "probe.so")
        except RuntimeError:
            return False
    return True


C_HELPERS_BUILD = _c_helpers_build()
needs_c_helpers = pytest.mark.skipif(
    not C_HELPERS_BUILD, reason="no working C compiler here to build spmd-cp's C helpers")


@pytest.fixture(scope="session")
def embedded_model() -> str:
    from spmd_cp.models.gguf import default_model_path

    return default_model_path()


def write_tiny_model(path: Path, model_type: str, seed: int = 0,
                     extra_config: dict | None = None) -> Path:
    """A random GQA model (8 query heads, 2 KV heads) saved in MLX format, with the
    embedded model's tokenizer so the CLI can run it like any downloaded model.

    ``extra_config`` is merged into config.json (e.g. a ``rope_scaling`` variant)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_REMAPPING

    from spmd_cp.models.gguf import build_tokenizer, default_model_path

    config = {
        "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 3,
        "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": model_type != "qwen3",
    }
    if model_type == "qwen2":
        config["attention_bias"] = True  # mlx-lm's qwen2 always has q/k/v biases
    config.update(extra_config or {})
    if model_type == "gemma3":  # multimodal: the language model's config nested
        config = {"model_type": "gemma3", "vocab_size": config["vocab_size"],
                  "text_config": {**config, "model_type": "gemma3_text"}}
    # mlx-lm runs some model types with another's code (mistral -> llama), as its loader does.
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger-than-default weights so attention is far from uniform and errors show.
    params = {k: v * 3 if v.ndim == 2 and "embed" not in k else v
              for k, v in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings", True):  # a tied head is not in the files
        params = {k: v for k, v in params.items() if not k.endswith("lm_head.weight")}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    import mlx.core as _mx

    _, meta = _mx.load(default_model_path(), return_metadata=True)
    build_tokenizer(meta)._tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: str(write_tiny_model(root / kind, kind, seed))
            for seed, kind in enumerate(("llama", "qwen3"))}


# Llama 3's frequency-dependent RoPE scaling. With head_dim 16 and theta 1e4 the rotary
# wavelengths run from 6 to 19,869 positions: against these bounds (1024 / low factor and
# 1024 / high factor) some are kept, one is smoothed and the longest are divided by factor.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


# A Gemma 3 text model: two sliding-window layers of 16 tokens for each global one (the
# real models' pattern is 6 and window 512-1,024), query_pre_attn_scalar apart from
# head_dim, local and global RoPE bases apart, and a tied head.
GEMMA3_CONFIG = {"num_hidden_layers": 4, "sliding_window": 16, "sliding_window_pattern": 3,
                 "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0,
                 "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True}


@pytest.fixture(scope="session")
def tiny_gemma3_models(tmp_path_factory) -> dict:
    """gemma3_text and a multimodal gemma3 checkpoint's text part (``text_config``)."""
    root = tmp_path_factory.mktemp("tiny_gemma3")
    return {kind: str(write_tiny_model(root / kind, kind, seed, GEMMA3_CONFIG))
            for seed, kind in enumerate(("gemma3_text", "gemma3"), start=20)}


@pytest.fixture(scope="session")
def tiny_variant_models(tmp_path_factory) -> dict:
    """The other supported families: qwen2 (q/k/v biases, untied head), mistral (run by
    mlx-lm's llama code) and llama with Llama 3 RoPE scaling."""
    root = tmp_path_factory.mktemp("tiny_variants")
    variants = {"qwen2": ("qwen2", {"tie_word_embeddings": False}),
                "mistral": ("mistral", {"tie_word_embeddings": False}),
                "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING})}
    return {name: str(write_tiny_model(root / name, kind, seed, extra))
            for seed, (name, (kind, extra)) in enumerate(variants.items(), start=10)}
