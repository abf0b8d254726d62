"""Files written whole or not at all: a temporary file in the target's directory, renamed
over it. Used by every output a run writes in one piece (score's records, the trace)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..errors import UserError


def create_temporary(directory: Path, stem: str) -> tuple[int, Path]:
    """A new file (mode 0666 less the umask, as ``open`` gives) under a fresh name."""
    path = directory / f"{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.open(path, flags, 0o666), path


def write_text_atomically(path: str, lines):
    """Write ``lines`` to ``path`` through a temporary file in its directory, fsync'ed and
    renamed over it: readers see the old file or the whole new one, never a part.

    A device or pipe (``/dev/stdout``) is written in place.
    """
    target = Path(path)
    try:
        if target.exists() and not target.is_file():
            with open(target, "w", encoding="utf-8") as out:
                out.writelines(lines)
            return
        fd, temporary = create_temporary(target.resolve().parent, f".{target.name}")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.writelines(lines)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror or error}") from None
