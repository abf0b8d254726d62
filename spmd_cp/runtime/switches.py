"""The environment variables a rank reads, read one way: only what must be known before
the process re-executes or before MLX and MPI load (the BLAS, its threads and its
matrix-vector forward, the allocator, huge pages, the scheduling policy; docs/USAGE.md's
table). Every other behaviour is a flag of the typed configuration (spmd_cp/config.py);
the three behaviour variables that became flags are read here too, for one more release
(cli/retired.py). Standard library only: these are read before MLX loads."""

from __future__ import annotations

import os

from ..errors import UserError

OFF = ("0", "off", "no", "false")


def switched_off(name: str) -> bool:
    """Whether the variable ``name`` turns its feature off ("0", "off", "no", "false",
    any case); unset or anything else leaves it on."""
    return os.environ.get(name, "").strip().lower() in OFF


def startup_value(name: str) -> str:
    """The variable ``name`` as set, stripped, its case kept ("" where unset): for the
    settings that take a path besides their words (``SPMD_CP_BLAS``,
    ``SPMD_CP_ALLOCATOR``) and the BLAS's thread counts."""
    return os.environ.get(name, "").strip()


def thread_count(names: tuple) -> int | None:
    """The first of the BLAS thread variables ``names`` set to a positive number, that
    number; None where none is."""
    for name in names:
        value = startup_value(name)
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def startup_setting(name: str, choices: tuple, default: str) -> str:
    """The variable ``name``, lower-cased, one of ``choices`` (``default`` where unset or
    empty); a UserError in one line for anything else."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise UserError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def retired_setting(name: str) -> str | None:
    """A behaviour variable that became a flag, read for one more release (cli/retired.py
    maps it onto the flag): lower-cased, None where unset or empty."""
    return os.environ.get(name, "").strip().lower() or None
