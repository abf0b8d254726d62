"""Small C libraries compiled on first use into the cache directory.

Three pieces of spmd-cp are C: the BLAS's matrix-vector forward (kernels/gemv_forward.c)
and the MPI ABI adapter MLX's MPI backend loads (runtime/mpi_abi_adapter.c), which stand in
for a C entry point another library calls, and the native decode step
(kernels/decode_step.c). They ship as sources inside the package (wheel and sdist), so the
wheel stays pure Python: each is built with the system's C compiler (``cc``, or ``$CC``) the first
time it is needed, into ``$SPMD_CP_CACHE/<kind>/<name>-<hash of the source>.so``, and
reused after; the forward is preloaded into every rank from there, so that directory
must be writable by its user only (``~/.cache/spmd-cp`` is). Standard library only (the
BLAS forward is built before MLX or MPI load).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .paths import cache_dir


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` or ``cc`` on the PATH, or None."""
    return shutil.which(os.environ.get("CC", "cc"))


def local_headers(source: Path) -> list[Path]:
    """The headers ``source`` includes from its own folder (``#include "name.h"``): part
    of what the built file is keyed by, and shipped beside it (pyproject's package data)."""
    found = []
    for line in source.read_text().splitlines():
        words = line.replace('"', " ").split()
        if len(words) == 2 and words[0] == "#include" and line.count('"') == 2:
            found.append(source.with_name(words[1]))
    return found


def built_path(source: Path, kind: str, name: str) -> Path:
    """Where ``source`` built for this platform lives in the cache (keyed by the source and
    its headers, the OS and the machine: a cache shared by x86 and ARM hosts keeps one of each).
    Raises RuntimeError when the source is missing (an install that left it out): the
    callers fall back as they do without a compiler."""
    target = f"{sys.platform}-{platform.machine()}".encode()
    try:
        text = source.read_bytes()
        text += b"".join(header.read_bytes() for header in local_headers(source))
    except OSError as error:
        raise RuntimeError(f"cannot read {source.name} ({error.strerror}): "
                           "reinstall spmd-cp") from error
    key = hashlib.sha256(text + target).hexdigest()[:16]
    return cache_dir() / kind / f"{name}-{key}.so"


def build(source: Path, target: Path) -> Path:
    """``target``, compiled from ``source`` unless it exists. Ranks on one host may build
    it at once: each compiles into a file of its own and renames it into place (the
    same bytes either way). Raises RuntimeError naming the first line of what failed."""
    if target.exists():
        return target
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, or $CC)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
    except OSError as error:  # e.g. a read-only cache directory
        raise RuntimeError(f"cannot write {target.parent}: {error}") from error
    command = [cc, "-O2", "-shared", "-fPIC", "-I", str(source.parent), "-o", scratch,
               str(source)]
    if sys.platform.startswith("linux"):
        command += ["-ldl", "-lpthread"]  # dlsym, threads (in libc itself from glibc 2.34)
    try:
        built = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if built.returncode != 0:
            first = (built.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{Path(cc).name} failed: {first}")
        os.replace(scratch, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{Path(cc).name} failed: {error}") from error
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target
