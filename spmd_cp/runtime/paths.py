"""Where spmd-cp keeps files between runs. Standard library only (reached before the
BLAS re-exec)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The on-disk cache directory (checksums, calibration, float32 weights):
    $SPMD_CP_CACHE or ~/.cache/spmd-cp, read at call time."""
    return Path(os.environ.get("SPMD_CP_CACHE", Path.home() / ".cache" / "spmd-cp"))
