"""sha256 of model files, so ranks (and saved prompt caches) can prove they use the same
model. Standard library only: cli.py reaches it before the BLAS re-exec.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import UserError
from ..runtime.paths import cache_dir

# Hashing reads the file in pieces of this size.
HASH_CHUNK = 8 << 20


def model_files(path: str) -> list[Path]:
    """The files whose bytes define a model: the GGUF file, or a directory's config.json
    and *.safetensors (sorted). Raises UserError when ``path`` is neither."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise UserError(f"model not found: {path}")
    if not (p / "config.json").is_file():
        raise UserError(f"model directory has no config.json: {path}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        raise UserError(f"model directory has no *.safetensors: {path}")
    return [p / "config.json"] + weights


def model_checksum(path: str) -> str:
    """sha256 (hex) of a model: of the GGUF file itself (the value `sha256sum` prints), or,
    for a directory, of the lines "<name> <sha256 of the file>\\n" of config.json and every
    *.safetensors in name order.

    Each file's hash is cached in <cache_dir>/checksums.json, keyed by its real path, size
    and modification time, so a second call costs a stat() per file. Raises UserError if
    ``path`` is not a model.
    """
    files = model_files(path)
    cache = _HashCache(cache_dir() / "checksums.json")
    digests = [cache.sha256(f) for f in files]
    cache.save()
    if Path(path).is_file():
        return digests[0]
    lines = "".join(f"{f.name} {d}\n" for f, d in zip(files, digests))
    return hashlib.sha256(lines.encode()).hexdigest()


class _HashCache:
    """sha256 of files by (real path, size, mtime), in one small JSON file."""

    def __init__(self, file: Path):
        self.file = file
        self.dirty = False
        self.hits = 0
        try:
            self.entries = json.loads(file.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def sha256(self, path: Path) -> str:
        real = os.path.realpath(path)
        stat = os.stat(real)
        key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        entry = self.entries.get(real)
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items()):
            self.hits += 1
            return entry["sha256"]
        digest = hashlib.sha256()
        try:
            with open(real, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    digest.update(chunk)
        except OSError as error:
            raise UserError(f"cannot read model file {path}: {error}") from None
        self.entries[real] = {**key, "sha256": digest.hexdigest()}
        self.dirty = True
        return digest.hexdigest()

    def save(self):
        """Write atomically (ranks on one host may save at once); a failure only costs a
        re-hash next time."""
        if not self.dirty:
            return
        tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}.tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
            os.replace(tmp, self.file)
        except OSError:
            tmp.unlink(missing_ok=True)


