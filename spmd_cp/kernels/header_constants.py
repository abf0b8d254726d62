"""Numbers the C kernels and the MLX code share, read from the C header that defines them.

kernels/exp_polynomial.h holds the exp polynomial's constants as ``#define NAME value``
lines; attention/exp.py computes the same polynomial through MLX and takes its numbers
from here, so the two cannot drift apart. Standard library only.
"""

from __future__ import annotations

import functools
from pathlib import Path

EXP_HEADER = Path(__file__).with_name("exp_polynomial.h")


@functools.lru_cache(maxsize=None)
def defines(header: Path = EXP_HEADER) -> dict[str, float]:
    """``{NAME: value}`` of the header's numeric ``#define NAME value`` lines (a comment
    after the value is allowed; macros with arguments and non-numbers are skipped)."""
    found = {}
    for line in header.read_text().splitlines():
        words = line.split("/*")[0].split()
        if len(words) == 3 and words[0] == "#define" and "(" not in words[1]:
            try:
                found[words[1]] = float(words[2])
            except ValueError:
                continue
    return found
