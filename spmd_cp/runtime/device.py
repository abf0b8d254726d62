"""Which MLX backend runs this rank, and which compute path follows from it.

Two paths, one program. The GPU path (MLX's Metal or CUDA backend) attends through
MLX's fused attention kernel and keeps the KV cache, ring messages and decode partials
in the model's dtype. The CPU path keeps the tiled float32 attention
(attention/block.py), which is faster than MLX's unfused CPU attention beyond a few
thousand keys, and a float32 KV cache (half-precision arithmetic on the MLX CPU backend
is 10-20x slower than float32 through BLAS: docs/CPU_SPEED.md).

The path and the attention kernel are decided once a run (``Compute.resolve``, from
``--device`` and ``--attention-kernel``) and passed to what depends on them: the model
(engine/model.py) carries its ``Compute``. ``--device gpu`` runs the GPU path on a CPU,
so that its exactness can be tested on a machine without a GPU (CI); ``--device cpu``
compares the CPU path on one with a GPU. Every rank of a job must take the same path
(the KV dtype fixes the messages' layout).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ..config import ATTENTION_KERNELS, DEVICES, RunConfig
from ..errors import UserError


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


@dataclass(frozen=True)
class Compute:
    """A run's compute path (``gpu`` or ``cpu``) and attention kernel (``fused``: MLX's
    fused attention, else the tiled float32 blocks), decided once."""

    path: str
    fused: bool

    @property
    def gpu(self) -> bool:
        return self.path == "gpu"

    @classmethod
    def resolve(cls, device: str = RunConfig.default("device"),
                attention_kernel: str = RunConfig.default("attention_kernel")) -> "Compute":
        """From ``--device`` (auto: the default device's type) and ``--attention-kernel``
        (auto: fused on the GPU path). The defaults are RunConfig's, for library callers."""
        if device not in DEVICES or attention_kernel not in ATTENTION_KERNELS:
            raise UserError(f"device {device!r}, attention kernel {attention_kernel!r}: "
                            f"expected one of {', '.join(DEVICES)} and one of "
                            f"{', '.join(ATTENTION_KERNELS)}")
        path = device if device != "auto" else ("cpu" if backend_name() == "cpu" else "gpu")
        fused = path == "gpu" if attention_kernel == "auto" else attention_kernel == "fused"
        return cls(path, fused)


@dataclass(frozen=True)
class BackendInfo:
    """What ``doctor`` and the ``--json`` summaries report about this rank's MLX."""

    backend: str
    device: str
    path: str

    @classmethod
    def of(cls, compute: Compute) -> "BackendInfo":
        return cls(backend_name(), device_description(), compute.path)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "device": self.device, "compute_path": self.path}


@functools.lru_cache(maxsize=None)
def compiled_kernels_work() -> bool:
    """Whether ``mx.compile``'d functions evaluate here; where they do not, compilation is
    turned off for the process (``mx.disable_compile``), so that every compiled function
    (spmd-cp's, mlx-lm's samplers and SwiGLU, MLX's activations) runs its ops one by one,
    the same arithmetic. On the CPU, MLX writes the kernels it generates under the
    temporary directory (``$TMPDIR/mlx``) and raises at evaluation where it cannot (a
    ``TMPDIR`` that is missing or read-only). Probed once, on a tiny function, before the
    first forward pass (run/builder.make_engine). (Without a C++ compiler MLX evaluates
    compiled functions op by op, silently: that works.)"""
    try:
        mx.eval(mx.compile(lambda x: x * 2.0 + 1.0)(mx.ones((4,))))
        return True
    except (RuntimeError, ValueError, OSError):
        mx.disable_compile()
        return False
