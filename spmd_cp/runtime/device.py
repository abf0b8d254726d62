"""Which MLX backend runs this rank, and which compute path follows from it.

Two paths, one program. The GPU path (MLX's Metal or CUDA backend) attends through
MLX's fused attention kernel and keeps the KV cache, ring messages and decode partials
in the model's dtype. The CPU path keeps the tiled float32 attention
(attention/block.py), which is faster than MLX's unfused CPU attention beyond a few
thousand keys, and a float32 KV cache (half-precision arithmetic on the MLX CPU backend
is 10-20x slower than float32 through BLAS: docs/CPU_SPEED.md).

``SPMD_CP_PATH=gpu|cpu`` overrides the choice, so that the GPU path's exactness can be
tested on a machine without a GPU (CI), and the CPU path compared on one with a GPU;
``SPMD_CP_ATTENTION=fused|tiled`` overrides the attention kernel alone. Every rank of a
job must take the same path (the KV dtype fixes the messages' layout).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import mlx.core as mx

from ..errors import UserError

PATH_ENV = "SPMD_CP_PATH"
PATHS = ("gpu", "cpu")


def backend_name() -> str:
    """``metal``, ``cuda`` or ``cpu``: the backend MLX's default device runs on."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "gpu"


def device_description() -> str:
    """The default device and, where MLX reports it, its name (e.g. the GPU's model)."""
    device = str(mx.default_device())
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        info = {}
    name = info.get("device_name")
    return f"{device} {name}" if name else device


def compute_path() -> str:
    """``gpu`` or ``cpu``: the environment override, else the default device's type."""
    forced = os.environ.get(PATH_ENV, "").strip().lower()
    if forced:
        if forced not in PATHS:
            raise UserError(f"{PATH_ENV}={forced!r}: expected one of {', '.join(PATHS)}")
        return forced
    return "cpu" if backend_name() == "cpu" else "gpu"


def on_gpu_path() -> bool:
    return compute_path() == "gpu"


@dataclass(frozen=True)
class BackendInfo:
    """What ``doctor`` and the ``--json`` summaries report about this rank's MLX."""

    backend: str
    device: str
    path: str

    @classmethod
    def current(cls) -> "BackendInfo":
        return cls(backend_name(), device_description(), compute_path())

    def as_dict(self) -> dict:
        return {"backend": self.backend, "device": self.device, "compute_path": self.path}


ATTENTION_ENV = "SPMD_CP_ATTENTION"
ATTENTION_KINDS = ("fused", "tiled")


def use_fused_attention() -> bool:
    """Whether attention runs through MLX's fused kernel (attention/fused.py) or the tiled
    float32 blocks (attention/block.py): ``SPMD_CP_ATTENTION=fused|tiled``, else fused on
    the GPU path."""
    forced = os.environ.get(ATTENTION_ENV, "").strip().lower()
    if forced:
        if forced not in ATTENTION_KINDS:
            raise UserError(f"{ATTENTION_ENV}={forced!r}: expected one of "
                            f"{', '.join(ATTENTION_KINDS)}")
        return forced == "fused"
    return on_gpu_path()


@functools.lru_cache(maxsize=None)
def compiled_kernels_work() -> bool:
    """Whether ``mx.compile``'d functions evaluate here; where they do not, compilation is
    turned off for the process (``mx.disable_compile``), so that every compiled function
    (spmd-cp's, mlx-lm's samplers and SwiGLU, MLX's activations) runs its ops one by one,
    the same arithmetic. On the CPU, MLX writes the kernels it generates under the
    temporary directory (``$TMPDIR/mlx``) and raises at evaluation where it cannot (a
    ``TMPDIR`` that is missing or read-only). Probed once, on a tiny function, before the
    first forward pass (cli/steps.make_engine). (Without a C++ compiler MLX evaluates
    compiled functions op by op, silently: that works.)"""
    try:
        mx.eval(mx.compile(lambda x: x * 2.0 + 1.0)(mx.ones((4,))))
        return True
    except (RuntimeError, ValueError, OSError):
        mx.disable_compile()
        return False
