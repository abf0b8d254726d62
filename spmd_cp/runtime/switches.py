"""The environment variables a rank reads, read one way: only what must be known before
the process re-executes or before MLX and MPI load (the BLAS and its matrix-vector
forward, the allocator, huge pages, the scheduling policy; docs/USAGE.md's table). Every
other behaviour is a flag of the typed configuration (spmd_cp/config.py). Standard
library only: these are read before MLX loads."""

from __future__ import annotations

import os

from ..errors import UserError

OFF = ("0", "off", "no", "false")


def switched_off(name: str) -> bool:
    """Whether the variable ``name`` turns its feature off ("0", "off", "no", "false",
    any case); unset or anything else leaves it on."""
    return os.environ.get(name, "").strip().lower() in OFF


def startup_setting(name: str, choices: tuple, default: str) -> str:
    """The variable ``name``, lower-cased, one of ``choices`` (``default`` where unset or
    empty); a UserError in one line for anything else."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise UserError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value
