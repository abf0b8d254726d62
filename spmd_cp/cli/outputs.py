"""Output paths: checked on rank 0 before any heavy work, written so nothing is lost.

A job refuses, in one line and before the model loads, an output that is one of its own
inputs (``score --output doc.txt --text-file doc.txt`` would replace the document by its
scores), an existing file unless ``--overwrite``, and a place it cannot write. The
writability probe creates a temporary file next to the output: ``os.access`` says yes to
everything when run as root. Standard library only.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..runtime.files import create_temporary


@dataclass(frozen=True)
class Output:
    flag: str  # how the user named it, e.g. "--output"
    path: str
    directory: bool = False  # a directory of files (--save-cache)
    writes: tuple[str, ...] = ()  # directory: glob patterns of the files written into it
    appended: bool = False  # batch results: an existing file is the --resume case


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file or directory (through symlinks and hard links)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(outputs: list[Output], inputs: dict[str, list], overwrite: bool):
    """Refuse outputs that are inputs, each other, existing files, or unwritable.

    ``inputs``: a label ("the prompt file") -> the paths it covers.
    """
    outputs = [o for o in outputs if o.path]
    for index, output in enumerate(outputs):
        for label, paths in inputs.items():
            if any(p and same_file(output.path, p) for p in paths):
                raise UserError(f"{output.flag} is {label}: {output.path}")
        for other in outputs[:index]:
            if same_file(output.path, other.path):
                raise UserError(f"{output.flag} and {other.flag} are the same file: {output.path}")
        if output.directory:
            _check_directory(output, overwrite)
        else:
            _check_file(output, overwrite)


def _check_file(output: Output, overwrite: bool):
    path = Path(output.path)
    if path.is_dir():
        raise UserError(f"{output.flag} is a directory: {path}")
    if path.exists() and not path.is_file():
        # A device or a pipe (/dev/stdout): written in place, nothing to replace.
        if not os.access(path, os.W_OK):
            raise UserError(f"output is not writable: {path}")
        probe_device(path)
        return
    if path.exists() and not overwrite and not output.appended:
        raise UserError(f"output {path} exists; use --overwrite to replace it")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UserError(f"output directory does not exist: {parent}")
    probe_writable(parent, output.path)
    if output.appended and path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as error:
            raise UserError(f"output is not writable: {path} ({error.strerror})") from None


def _check_directory(output: Output, overwrite: bool):
    path = Path(output.path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{output.flag} is not a directory: {path}")
    if path.is_dir() and not overwrite:
        held = sorted({p.name for pattern in output.writes for p in path.glob(pattern)})
        if held:
            raise UserError(f"{output.flag} {path} already holds {', '.join(held[:3])}"
                            f"{' ...' if len(held) > 3 else ''}; use --overwrite to replace it")
    # The directory and its missing parents are created later: the nearest existing
    # ancestor must take new entries.
    existing = next(p for p in [path.resolve(), *path.resolve().parents] if p.exists())
    if not existing.is_dir():
        raise UserError(f"{output.flag} cannot be created under the file {existing}")
    probe_writable(existing, output.path)


def probe_device(path: Path):
    """Write nothing to a device or pipe: a write of zero bytes still fails where every
    write would (/dev/full: ENOSPC), and puts nothing into one that works. A FIFO nobody
    reads yet is not opened (ENXIO without blocking): its reader may come later."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        if error.errno == errno.ENXIO:
            return
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    try:
        os.write(fd, b"")
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    finally:
        os.close(fd)


def probe_writable(directory: Path, named: str):
    """Create and remove a temporary file in ``directory``, or refuse ``named``."""
    try:
        probe = create_temporary(directory, ".spmd-cp-probe")
    except OSError as error:
        raise UserError(f"output is not writable: {named} (cannot create a file in "
                        f"{directory}: {error.strerror})") from None
    os.close(probe[0])
    os.unlink(probe[1])


# -- claims: one run per output -----------------------------------------------------------
_CLAIMS: list = []  # (fd, lock file) held for the process's life


def claim_path(output: Output) -> Path:
    """The lock file beside an output: ``.NAME.spmd-cp-claim`` in its directory."""
    target = Path(os.path.realpath(output.path))
    return target.parent / f".{target.name}.spmd-cp-claim"


def claim_outputs(outputs: list[Output]):
    """Claim every output for this process's life, or refuse in one line when another
    running process holds one (whatever --overwrite says).

    The claim is a POSIX lock (``lockf``) on a file beside the output, holding the
    holder's pid: the kernel drops it when its process ends, however it ends, so a
    crashed run's claim is taken over by the next run. Devices and pipes are not
    claimed; a place no claim can be made in is left to ``check_outputs`` to refuse.
    """
    import atexit
    import fcntl

    for output in outputs:
        if not output.path:
            continue
        path = Path(output.path)
        if path.exists() and not path.is_file() and not path.is_dir():
            continue
        lock = claim_path(output)
        if output.directory:
            try:
                # One place for the claim, before and after the run creates the
                # directories (--save-cache new/dir): its parents are made now, as
                # saving would. A file's missing directory is refused by check_outputs.
                lock.parent.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue  # check_outputs names the problem
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError:
                break  # no place for a claim: check_outputs names the problem
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise UserError(f"{output.flag} {output.path} is in use by another spmd-cp "
                                f"run (pid {holder}); wait for it to end or choose another "
                                f"path") from None
            # The file may have been removed (its holder ended) between open and lock:
            # then this lock guards nothing; take the new file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except OSError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _CLAIMS.append((fd, lock))
            if len(_CLAIMS) == 1:
                atexit.register(release_claims)
            break


def release_claims():
    """Remove this process's claim files (while still holding them) and drop the locks."""
    while _CLAIMS:
        fd, lock = _CLAIMS.pop()
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)
