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
missing or corrupt shard, and any field of meta.json or tensor of a shard that is not
what ``save_cache`` writes (``check_meta``, ``check_shard``): a sha256 proves a shard
is the one meta.json names, not that either was written by spmd-cp.

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

from ...runtime import spmd
from .cache import ShardedKVCache
from ...runtime.comm import Comm
from ...runtime.grid import Grid
from ...errors import UserError
from ...text_input import unicode_problem

FORMAT = 1
META = "meta.json"
# No tokenizer has this many tokens: ids at or past it are refused before the model
# loads (those past the model's own vocabulary once it is known).
MAX_TOKEN_ID = 1 << 31
ROLES = ("system", "user", "assistant")


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
               conversation: dict, grid: Grid | None = None):
    """Write this rank's shard; rank 0 then writes meta.json (collective). ``grid``: the
    CP x TP grid (None: one CP group of every rank), which meta.json records (``cp_size``,
    and ``tp_size`` where above 1): a shard per world rank, each its KV heads of its CP
    rank's positions."""
    grid = grid or Grid(comm, comm, None)
    out = Path(directory)
    arrays, shared = cache.state()
    holds = _holds_kv(grid)

    def write_shard():
        if not holds:  # an FFN rank (--afd): no shard
            return None
        try:
            out.mkdir(parents=True, exist_ok=True)
            if comm.rank == 0:
                (out / META).unlink(missing_ok=True)  # incomplete until rewritten
            return _write_new_file(out / shard_name(comm.rank, comm.size),
                                   lambda f: mx.save_safetensors(f, arrays))
        except OSError as error:
            raise UserError(f"cannot write prompt cache {directory}: {error}") from None

    digests = [d for d in comm.allgather_object(spmd.everywhere(comm, write_shard))
               if d is not None]

    def write_meta():
        meta = {"format": FORMAT, "model_checksum": model_checksum, "cp_size": grid.cp.size,
                **({"tp_size": grid.tp_size} if grid.tp is not None else {}),
                **({"afd": _afd_of(grid)} if grid.afd is not None else {}),
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
    except RecursionError:
        raise UserError(f"prompt cache {directory} is corrupt ({META} is nested too deeply)") \
            from None
    if not isinstance(meta, dict):
        raise UserError(f"prompt cache {directory} is corrupt ({META} is not a JSON object)")
    if meta.get("format") != FORMAT:
        raise UserError(f"prompt cache {directory} has format {meta.get('format')!r}, "
                        f"this spmd-cp reads format {FORMAT}")
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"prompt cache {directory} is corrupt ({META}: {problem})")
    return meta


# -- what a cache must hold (one schema, checked before any of it is used) --------------
def _is_int(value, low: int, high: int | None = None) -> bool:
    """An integer (JSON's, not a bool) in [low, high)."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value < high))


def _is_text(value) -> bool:
    """A string that is valid Unicode (the rule of spmd_cp/text_input.py: JSON's \\ud800
    escapes give lone surrogates)."""
    return isinstance(value, str) and unicode_problem(value) is None


def _is_sha256(value) -> bool:
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value))


def meta_problem(meta: dict) -> str | None:
    """What is wrong with a meta.json of format 1, field by field (None: nothing).

    The fields, as ``save_cache`` writes them: model_checksum (sha256 hex), cp_size
    (ranks, >= 1), num_tokens, token_ids (num_tokens ids in [0, 2^31)), shard_sizes
    (cp_size counts summing to num_tokens), decode_steps (<= num_tokens), decode_owner
    (a CP rank), shard_sha256 (one sha256 hex a rank: cp_size x tp_size), conversation
    ({"messages": [{"role": system/user/assistant, "content": text}], "text": text}); and
    where the grid had TP groups, tp_size (>= 1; absent: 1); where the ranks were split
    into attention and FFN ranks, afd ("A:F", A = cp_size: the FFN ranks keep no shard).
    """
    fields = ("model_checksum", "cp_size", "num_tokens", "token_ids", "shard_sizes",
              "decode_steps", "decode_owner", "shard_sha256", "conversation")
    missing = [name for name in fields if name not in meta]
    if missing:
        return "no " + ", ".join(repr(name) for name in missing)
    if not _is_sha256(meta["model_checksum"]):
        return "'model_checksum' is not a sha256"
    cp_size, num_tokens = meta["cp_size"], meta["num_tokens"]
    if not _is_int(cp_size, 1):
        return f"'cp_size' must be an integer >= 1, not {_shown(cp_size)}"
    tp_size = meta.get("tp_size", 1)
    if not _is_int(tp_size, 1):
        return f"'tp_size' must be an integer >= 1, not {_shown(tp_size)}"
    afd = meta.get("afd")
    if afd is not None and not (isinstance(afd, str) and afd.count(":") == 1
                                and afd.split(":")[0] == str(cp_size)
                                and afd.split(":")[1].isdigit()):
        return f"'afd' must be 'A:F' with A = cp_size ({cp_size}), not {_shown(afd)}"
    if not _is_int(num_tokens, 0):
        return f"'num_tokens' must be an integer >= 0, not {_shown(num_tokens)}"
    ids = meta["token_ids"]
    if not isinstance(ids, list) or len(ids) != num_tokens:
        return f"'token_ids' must be a list of num_tokens ({num_tokens}) token ids"
    bad = next((i for i, t in enumerate(ids) if not _is_int(t, 0, MAX_TOKEN_ID)), None)
    if bad is not None:
        return f"'token_ids'[{bad}] is {_shown(ids[bad])}, not a token id"
    sizes = meta["shard_sizes"]
    if (not isinstance(sizes, list) or len(sizes) != cp_size
            or not all(_is_int(n, 0) for n in sizes) or sum(sizes) != num_tokens):
        return (f"'shard_sizes' must be cp_size ({cp_size}) counts summing to num_tokens "
                f"({num_tokens})")
    if not _is_int(meta["decode_steps"], 0, num_tokens + 1):
        return f"'decode_steps' must be an integer in [0, {num_tokens}]"
    if not _is_int(meta["decode_owner"], 0, cp_size):
        return f"'decode_owner' must be a rank in [0, {cp_size - 1}]"
    digests = meta["shard_sha256"]
    if not (isinstance(digests, list) and len(digests) == cp_size * tp_size
            and all(_is_sha256(d) for d in digests)):
        return f"'shard_sha256' must be cp_size x tp_size ({cp_size * tp_size}) sha256 digests"
    return _conversation_problem(meta["conversation"])


def _conversation_problem(conversation) -> str | None:
    if not isinstance(conversation, dict):
        return "'conversation' is not an object"
    if not _is_text(conversation.get("text")):
        return "'conversation.text' is not text"
    messages = conversation.get("messages")
    if not isinstance(messages, list):
        return "'conversation.messages' is not a list"
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES
                and _is_text(message.get("content"))):
            return (f"'conversation.messages'[{index}] is not a message (a role of "
                    f"{'/'.join(ROLES)} and text content)")
    return None


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_shard(arrays: dict, rank: int, meta: dict, num_layers: int) -> str | None:
    """What is wrong with rank ``rank``'s shard (None: nothing): "positions", this rank's
    shard size of increasing integer positions below num_tokens; and, for a shard that
    holds any, "layer.<i>.keys"/"values" of every layer, (heads, shard size, dim) floats
    of one shape each across the layers; no other tensor."""
    size = meta["shard_sizes"][rank]
    positions = arrays.get("positions")
    if positions is None:
        return "no 'positions' tensor"
    if (positions.ndim != 1 or positions.size != size
            or not mx.issubdtype(positions.dtype, mx.integer)):
        return f"'positions' is not {size} integer positions"
    values = np.asarray(positions, np.int64)
    if size and (values[0] < 0 or values[-1] >= meta["num_tokens"]
                 or np.any(np.diff(values) <= 0)):
        return f"'positions' are not increasing positions below {meta['num_tokens']}"
    layers = [f"layer.{i}.{part}" for i in range(num_layers) for part in ("keys", "values")]
    expected = {"positions", *(layers if size else [])}
    if set(arrays) != expected:
        names = sorted(set(arrays) - expected) or sorted(expected - set(arrays))
        which = "unexpected" if set(arrays) - expected else "missing"
        return f"{which} tensors {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
    for part in ("keys", "values"):
        shapes = {arrays[f"layer.{i}.{part}"].shape for i in range(num_layers)} if size else set()
        if len(shapes) > 1 or any(len(s) != 3 or s[1] != size for s in shapes):
            return f"the layers' {part} are not (heads, {size}, dim) arrays of one shape"
    if size and not all(mx.issubdtype(arrays[name].dtype, mx.floating) for name in layers):
        return "a layer's keys or values are not floating point"
    return None


def refuse_other_layout(comm: Comm, directory: str, meta: dict, grid: Grid):
    """UserError where the cache was made on another layout of ranks than ``grid``'s,
    naming the launch that continues it."""
    if meta.get("afd") != _afd_of(grid):
        made_as = f"--afd {meta['afd']}" if meta.get("afd") else "without --afd"
        job_as = f"--afd {_afd_of(grid)}" if grid.afd is not None else "without --afd"
        raise UserError(f"prompt cache {directory} was made {made_as}; this job runs "
                        f"{job_as} (continue it as it was made)")
    made = (meta["cp_size"], meta.get("tp_size", 1))
    cp_size = grid.afd.roles.attention if grid.afd is not None else grid.cp.size
    if made != (cp_size, grid.tp_size):
        if made[1] == 1 and grid.tp is None:
            raise UserError(f"prompt cache {directory} was made on {made[0]} ranks; this job "
                            f"has {comm.size} (run with mpiexec -n {made[0]})")
        raise UserError(f"prompt cache {directory} was made on {made[0] * made[1]} ranks as "
                        f"--tp {made[1]}; this job has {comm.size} as --tp {grid.tp_size} "
                        f"(run with mpiexec -n {made[0] * made[1]} and --tp {made[1]})")


def _holds_kv(grid: Grid) -> bool:
    """Whether this rank keeps a shard: every rank but ``--afd``'s FFN ranks."""
    return grid.afd is None or grid.afd.attention


def _afd_of(grid: Grid) -> str | None:
    """``--afd``'s A:F of the grid, or None."""
    if grid.afd is None:
        return None
    return f"{grid.afd.roles.attention}:{grid.afd.roles.ffn}"


def load_cache(comm: Comm, directory: str, meta: dict, model_checksum: str,
               num_layers: int, dtype=None, vocab_size: int | None = None,
               grid: Grid | None = None) -> ShardedKVCache:
    """Every rank loads its own shard of a cache written for the same model and grid
    (``meta``: as ``read_meta`` checked it; ``dtype``: the KV dtype of the engine that
    continues it; ``vocab_size``: the model's, which every token id must be below;
    ``grid``: this job's CP x TP grid, None: one CP group of every rank)."""
    grid = grid or Grid(comm, comm, None)
    if vocab_size and meta["token_ids"] and max(meta["token_ids"]) >= vocab_size:
        raise UserError(f"prompt cache {directory} is corrupt ({META}: token id "
                        f"{max(meta['token_ids'])} is past the model's vocabulary of "
                        f"{vocab_size})")
    if meta["model_checksum"] != model_checksum:
        raise UserError(f"prompt cache {directory} was made with another model "
                        f"(checksum {meta['model_checksum'][:12]}..., this model "
                        f"{model_checksum[:12]}...)")
    refuse_other_layout(comm, directory, meta, grid)
    holds = _holds_kv(grid)

    def read_shard():
        if not holds:
            return None
        path = Path(directory) / shard_name(comm.rank, comm.size)
        try:
            if _sha256(path) != meta["shard_sha256"][comm.rank]:
                raise UserError(f"prompt cache shard {path} is corrupt (sha256 mismatch)")
            arrays = mx.load(str(path))
        except FileNotFoundError:
            raise UserError(f"prompt cache shard missing: {path}") from None
        except (OSError, ValueError, RuntimeError) as error:
            raise UserError(f"prompt cache shard {path} is corrupt: {error}") from None
        if not isinstance(arrays, dict):
            raise UserError(f"prompt cache shard {path} is corrupt (not a safetensors file)")
        problem = check_shard(arrays, grid.cp.rank, meta, num_layers)
        if problem:
            raise UserError(f"prompt cache shard {path} is corrupt ({problem})")
        return arrays

    arrays = spmd.everywhere(comm, read_shard)
    if not holds:
        return ShardedKVCache(num_layers, grid.cp.rank, grid.cp.size, dtype)
    layouts = grid.cp.allgather_object(_layout(arrays))  # a TP rank's heads are its own
    if len({layout for layout in layouts if layout}) > 1:
        raise UserError(f"prompt cache {directory} is corrupt (the shards' keys and values "
                        f"differ in shape: {sorted(set(layouts) - {None})})")
    positions = grid.cp.allgather_object(np.asarray(arrays["positions"], np.int64))
    every = np.sort(np.concatenate(positions)) if positions else np.zeros(0, np.int64)
    if not np.array_equal(every, np.arange(meta["num_tokens"])):
        raise UserError(f"prompt cache {directory} is corrupt (the shards' positions are not "
                        f"0 .. {meta['num_tokens'] - 1} once each)")
    try:
        return ShardedKVCache.from_state(num_layers, grid.cp.rank, positions, arrays, meta,
                                         dtype)
    except ValueError as error:
        raise UserError(f"prompt cache {directory} is corrupt ({error})") from None


def _layout(arrays: dict):
    """(heads, dim) of a shard's keys and values and their dtypes; None when it holds none."""
    if "layer.0.keys" not in arrays:
        return None
    keys, values = arrays["layer.0.keys"], arrays["layer.0.values"]
    return (keys.shape[0], keys.shape[2], values.shape[0], values.shape[2], str(keys.dtype),
            str(values.dtype))


def common_prefix_length(cached: np.ndarray, ids: np.ndarray) -> int:
    """How many leading tokens of ``ids`` the cache already holds.

    At most len(ids) - 1: the last prompt token is always recomputed, because its
    logits (not kept in the cache) are what the first answer token is sampled from.
    """
    n = min(len(cached), len(ids) - 1)
    mismatch = np.flatnonzero(np.asarray(cached[:n]) != np.asarray(ids[:n]))
    return int(mismatch[0]) if mismatch.size else n
