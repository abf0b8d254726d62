"""The matrix-vector forward (gemv_forward.c): built on first use, preloaded ahead of the BLAS.

A decode step multiplies every weight matrix by one token's vector. MLX hands each of
those products to ``cblas_sgemm``, which OpenBLAS before 0.3.27 runs through its GEMM
path (it packs the whole matrix first): 9-11 GB/s on the 2-core test machine, where its
``cblas_sgemv`` streams the same matrices at 21-33 GB/s. The forward is a small C
library exporting ``cblas_sgemm``: matrix-vector shapes go to the BLAS's sgemv, all
others to its sgemm. It is compiled with the system's C compiler into the cache
directory once (keyed by its source), and blas/reexec.py puts it first in LD_PRELOAD.

``SPMD_CP_GEMV_FORWARD=0`` leaves it out; without a C compiler it is left out too (the
BLAS is used as is). Standard library only: this runs before MLX or MPI is loaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENV_FORWARD = "SPMD_CP_GEMV_FORWARD"  # "0", "off", "no" or "false": do not preload it
SOURCE = Path(__file__).with_name("gemv_forward.c")
PREFIX = "spmd-cp-gemv-forward-"


def _cache_dir() -> Path:
    from ..runtime.paths import cache_dir  # standard library only as well

    return cache_dir()


def wanted() -> bool:
    return os.environ.get(ENV_FORWARD, "").strip().lower() not in ("0", "off", "no", "false")


def is_forward_library(path: str | None) -> bool:
    return bool(path) and os.path.basename(path).startswith(PREFIX)


def forward_library() -> tuple[str | None, str]:
    """(path of the built forward, "") or (None, why not). Builds it on first use; ranks
    on one host may build it at once (each into its own file, renamed into place)."""
    if not wanted():
        return None, f"{ENV_FORWARD}={os.environ[ENV_FORWARD]}"
    if not sys.platform.startswith("linux"):
        return None, "not Linux"  # macOS: MLX calls Accelerate
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source).hexdigest()[:16]
    target = _cache_dir() / "blas" / f"{PREFIX}{key}.so"
    if target.exists():
        return str(target), ""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, "no C compiler (cc, or $CC)"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
    except OSError as error:
        return None, f"cache directory: {error}"
    try:
        built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", scratch,
                                str(SOURCE), "-ldl"], capture_output=True, text=True,
                               timeout=120)
        if built.returncode != 0:
            return None, "build failed: " + (built.stderr.strip().splitlines() or ["?"])[0]
        os.replace(scratch, target)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"build failed: {error}"
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return str(target), ""
