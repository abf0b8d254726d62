"""The behaviour variables that became flags, still honoured for this release.

``SPMD_CP_PATH``, ``SPMD_CP_ATTENTION`` and ``SPMD_CP_WEIGHT_CACHE`` chose the compute
path, the attention kernel and the on-disk weight cache below the command line;
``--device``, ``--attention-kernel`` and ``--no-weight-cache`` choose them now. Where
one is set and its flag left at the default, the variable still decides and rank 0
prints one line naming the flag; a flag given wins. The next release reads them no more
(docs/USAGE.md, "Environment").
"""

from __future__ import annotations

import dataclasses
import sys

from ..config import RunConfig
from ..errors import UserError
from ..runtime.switches import OFF, retired_setting


def _choice(*values: str):
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return raw
    return parse


# variable: (the RunConfig field it set, its value -> the field's, the flag, the flag
# that gives a value)
RETIRED = {
    "SPMD_CP_PATH": ("device", _choice("gpu", "cpu"), "--device", "--device {}".format),
    "SPMD_CP_ATTENTION": ("attention_kernel", _choice("fused", "tiled"), "--attention-kernel",
                          "--attention-kernel {}".format),
    # "0" turned the cache off (so do "off", "no", "false", as for the start-up
    # switches); anything else leaves it on.
    "SPMD_CP_WEIGHT_CACHE": ("weight_cache", lambda raw: raw not in OFF, "--no-weight-cache",
                             lambda on: "--weight-cache" if on else "--no-weight-cache"),
}


def honour_retired(run: RunConfig, speaks: bool) -> RunConfig:
    """``run`` with each retired variable set in this process's environment applied
    where its flag is at its default; ``speaks``: print the deprecation lines (rank 0).
    A value the variable never took is a UserError naming the flag."""
    changes = {}
    for name, (field, parse, flag, giving) in RETIRED.items():
        raw = retired_setting(name)
        if raw is None:
            continue
        try:
            value = parse(raw)
        except ValueError as error:
            raise UserError(f"{name}={raw!r}: {error} (the variable is deprecated: use "
                            f"{flag})") from None
        if speaks:
            print(f"spmd-cp: warning: {name} is deprecated and the next release will not "
                  f"read it: use {giving(value)}", file=sys.stderr, flush=True)
        if getattr(run, field) == RunConfig.default(field):
            changes[field] = value
    return dataclasses.replace(run, **changes)
