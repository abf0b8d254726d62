"""Where distributions put shared libraries (the BLAS, jemalloc). A leaf: standard
library only, imported by the BLAS lookup (blas/libraries.py) and the allocator alike."""

from __future__ import annotations

import os
import platform
import sys
import sysconfig


def library_dirs() -> list[str]:
    """The folders to look for a system library in, most specific first."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/lib64", "/usr/lib",
            "/usr/local/lib", "/opt/OpenBLAS/lib", os.path.join(sys.prefix, "lib")]
    if os.environ.get("CONDA_PREFIX"):
        dirs.append(os.path.join(os.environ["CONDA_PREFIX"], "lib"))
    return dirs
