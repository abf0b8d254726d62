"""The on/off environment switches (SPMD_CP_FAST_EXP, SPMD_CP_GEMV_FORWARD,
SPMD_CP_NATIVE_DECODE, SPMD_CP_QUANTIZED_DECODE: docs/USAGE.md's table), read one way.
Standard library only: the BLAS forward's switch is read before MLX loads."""

from __future__ import annotations

import os

OFF = ("0", "off", "no", "false")


def switched_off(name: str) -> bool:
    """Whether the variable ``name`` turns its feature off ("0", "off", "no", "false",
    any case); unset or anything else leaves it on."""
    return os.environ.get(name, "").strip().lower() in OFF
