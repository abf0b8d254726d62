"""Sharded prompt caches on disk: ask many questions about one long document.

Layout of a cache directory for N ranks:

    rank-0-of-N.safetensors ... rank-(N-1)-of-N.safetensors
        each rank's K/V shard ("layer.<i>.keys", "layer.<i>.values", (NKV, S_r, d), in
        the cache's dtype: --kv-dtype on the CPU path) and its global positions
        ("positions"); a run with another --kv-dtype converts the shard to its own on
        load (widening is exact, narrowing rounds to nearest even)
    meta.json
        format, model checksum, N, token ids, the conversation so far, shard sizes and
        the sha256 of every shard file; written last (atomically), so a directory
        whose meta.json exists is complete

Every rank writes and reads only its own shard: the cache is never gathered. Loading
refuses, with one clear line, a cache from another model, another rank count, a
missing or corrupt shard.

Every file is written under a fresh name created by this process (O_CREAT | O_EXCL |
O_NOFOLLOW) and renamed into place: a symlink planted in the directory under a final or
a temporary name is replaced, never written through, so nothing outside the directory
is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..runtime import spmd
from .cache import ShardedKVCache
from ..runtime.comm import Comm
from ..errors import UserError

FORMAT = 1
META = "meta.json"


def shard_name(rank: int, size: int) -> str:
    return f"rank-{rank}-of-{size}.safetensors"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f)


def _sha256_of(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(1 << 22):
        digest.update(chunk)
    return digest.hexdigest()


def _write_new_file(path: Path, write) -> str:
    """Write ``path`` through a file this process creates and rename it into place.

    ``write(f)`` fills the binary file object. mkstemp opens with O_CREAT | O_EXCL |
    O_NOFOLLOW, so a planted symlink is never followed; rename(2) replaces a link at
    ``path`` itself, not its target. Returns the sha256 of the bytes written.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the cache from a shared group
        with os.fdopen(fd, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            digest = _sha256_of(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def save_cache(comm: Comm, cache: ShardedKVCache, directory: str, model_checksum: str,
               conversation: dict):
    """Write this rank's shard; rank 0 then writes meta.json (collective)."""
    out = Path(directory)
    arrays, shared = cache.state()

    def write_shard():
        try:
            out.mkdir(parents=True, exist_ok=True)
            if comm.rank == 0:
                (out / META).unlink(missing_ok=True)  # incomplete until rewritten
            return _write_new_file(out / shard_name(comm.rank, comm.size),
                                   lambda f: mx.save_safetensors(f, arrays))
        except OSError as error:
            raise UserError(f"cannot write prompt cache {directory}: {error}") from None

    digests = comm.allgather_object(spmd.everywhere(comm, write_shard))

    def write_meta():
        meta = {"format": FORMAT, "model_checksum": model_checksum, "cp_size": comm.size,
                **shared, "shard_sha256": digests, "conversation": conversation}
        try:
            _write_new_file(out / META, lambda f: f.write(json.dumps(meta).encode()))
        except OSError as error:
            raise UserError(f"cannot write prompt cache {directory}: {error}") from None

    spmd.on_root(comm, write_meta)


def read_meta(directory: str, bound: int | None = None) -> dict:
    """meta.json of a cache directory (rank 0; cheap: run before loading the model),
    refused when larger than ``bound`` bytes."""
    path = Path(directory) / META
    if not Path(directory).is_dir():
        raise UserError(f"prompt cache not found: {directory}")
    try:
        if path.exists() and not path.is_file():
            raise UserError(f"prompt cache {directory} is corrupt ({META} is not a file)")
        if bound is not None and path.stat().st_size > bound:
            raise UserError(f"prompt cache {directory}: {META} is larger than {bound} bytes "
                            f"({path.stat().st_size}); not a cache this model could continue")
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"prompt cache {directory} is incomplete (no {META})") from None
    except (OSError, ValueError) as error:
        raise UserError(f"prompt cache {directory} is corrupt ({META}: {error})") from None
    if not isinstance(meta, dict):
        raise UserError(f"prompt cache {directory} is corrupt ({META} is not a JSON object)")
    if meta.get("format") != FORMAT:
        raise UserError(f"prompt cache {directory} has format {meta.get('format')!r}, "
                        f"this spmd-cp reads format {FORMAT}")
    return meta


def load_cache(comm: Comm, directory: str, meta: dict, model_checksum: str,
               num_layers: int, dtype=None) -> ShardedKVCache:
    """Every rank loads its own shard of a cache written for the same model and N
    (``dtype``: the KV dtype of the engine that continues it)."""
    if meta["model_checksum"] != model_checksum:
        raise UserError(f"prompt cache {directory} was made with another model "
                        f"(checksum {meta['model_checksum'][:12]}..., this model "
                        f"{model_checksum[:12]}...)")
    if meta["cp_size"] != comm.size:
        raise UserError(f"prompt cache {directory} was made on {meta['cp_size']} ranks; "
                        f"this job has {comm.size} (run with mpiexec -n {meta['cp_size']})")

    def read_shard():
        path = Path(directory) / shard_name(comm.rank, comm.size)
        try:
            if _sha256(path) != meta["shard_sha256"][comm.rank]:
                raise UserError(f"prompt cache shard {path} is corrupt (sha256 mismatch)")
            return mx.load(str(path))
        except FileNotFoundError:
            raise UserError(f"prompt cache shard missing: {path}") from None
        except (OSError, ValueError, RuntimeError) as error:
            raise UserError(f"prompt cache shard {path} is corrupt: {error}") from None

    arrays = spmd.everywhere(comm, read_shard)
    positions = comm.allgather_object(np.asarray(arrays["positions"], np.int64))
    try:
        return ShardedKVCache.from_state(num_layers, comm.rank, positions, arrays, meta,
                                         dtype)
    except ValueError as error:
        raise UserError(f"prompt cache {directory} is corrupt ({error})") from None


def common_prefix_length(cached: np.ndarray, ids: np.ndarray) -> int:
    """How many leading tokens of ``ids`` the cache already holds.

    At most len(ids) - 1: the last prompt token is always recomputed, because its
    logits (not kept in the cache) are what the first answer token is sampled from.
    """
    n = min(len(cached), len(ids) - 1)
    mismatch = np.flatnonzero(np.asarray(cached[:n]) != np.asarray(ids[:n]))
    return int(mismatch[0]) if mismatch.size else n
