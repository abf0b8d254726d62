"""Reading the user's inputs with a bound, on rank 0, before anything heavy.

A prompt, a document, a jobs file, a cache's meta.json: each is read with a limit on
its size, so ``--prompt-file /dev/zero`` is refused in one line instead of filling the
host's memory. The limit follows from the model's context: a prompt longer than the
context is refused after tokenization anyway, and no tokenizer packs more than a few
dozen bytes of text into one token, so ``INPUT_BYTES_PER_TOKEN`` bytes a token of
context is a generous bound (the embedded model's 8,192 tokens: 256 KiB, raised to the
floor ``MIN_INPUT_BYTES``), capped by a share of ``--memory-limit``.

A file with a size (a regular file) is checked from that size before it is read; a pipe,
a FIFO, standard input or a device is read in chunks and stopped once past the bound.
A read that sees no data for ``--comm-timeout`` seconds (default 45; 0: wait forever)
stops too, naming the file: a FIFO nobody writes to cannot hang the job (a terminal on
standard input is waited for: someone is typing).

Standard library only (and the model's header readers for its context length).
"""

from __future__ import annotations

import os
import select
import stat
import sys
from pathlib import Path

from ..errors import UserError

# Bytes of input allowed per token of context (typical English text: about 4).
INPUT_BYTES_PER_TOKEN = 32
# Where the model's context length cannot be read before loading it: a million tokens.
FALLBACK_CONTEXT_TOKENS = 1 << 20
# Smallest bound, whatever the context (a tiny model's config).
MIN_INPUT_BYTES = 1 << 20
# A cache's meta.json holds the conversation twice (its messages and its text), each
# possibly escaped as \uXXXX in JSON: up to 12 bytes per byte of text.
META_FACTOR = 12
# A job line holds one prompt as a JSON string (escapes: up to 6 bytes per byte).
JOB_LINE_FACTOR = 6
# The whole jobs file: many jobs, each bounded by its line.
JOBS_FILE_BYTES = 1 << 30
# The text, its ids and the tokenizer's copies stay far below this share of a rank's memory.
MEMORY_SHARE = 8
CHUNK = 1 << 16
DEFAULT_READ_TIMEOUT_S = 45.0


def model_context_tokens(model_path: str | None) -> int | None:
    """The model's context length from its GGUF header or config.json, without loading
    it; None where it cannot be read (the model's own check reports why, later)."""
    import json

    try:
        from ..models.loader import default_model_path

        path = Path(model_path or default_model_path())
        # Regular files only: opening a FIFO given as --model would wait for its writer.
        if path.is_dir():
            config_file = path / "config.json"
            if not config_file.is_file() or config_file.stat().st_size > MIN_INPUT_BYTES:
                return None
            value = json.loads(config_file.read_text(encoding="utf-8")).get(
                "max_position_embeddings")
        elif not path.is_file() or path.suffix.lower() != ".gguf":
            return None
        else:
            from ..models.gguf_header import read_gguf_metadata

            meta = read_gguf_metadata(str(path), stop_when=lambda m: any(
                k.endswith(".context_length") for k in m))
            value = next((v for k, v in meta.items() if k.endswith(".context_length")), None)
        value = int(value)
        return value if value > 0 else None
    except Exception:  # noqa: BLE001 - a guess for a bound; the model's check comes later
        return None


def input_bound(max_context: int | None, model_path: str | None,
                memory_limit: str | None = None) -> int:
    """Bytes a prompt or document may have: ``INPUT_BYTES_PER_TOKEN`` per token of
    ``--max-context``, else of the model's context, and no more than
    1/``MEMORY_SHARE`` of the memory a rank may use (``--memory-limit``)."""
    tokens = max_context or model_context_tokens(model_path) or FALLBACK_CONTEXT_TOKENS
    return context_bound(tokens, memory_limit)


def context_bound(tokens: int | None, memory_limit: str | None = None) -> int:
    from ..engine.cache.forecast import default_memory_limit, parse_bytes

    memory = parse_bytes(memory_limit) if memory_limit else default_memory_limit()
    bound = (tokens or FALLBACK_CONTEXT_TOKENS) * INPUT_BYTES_PER_TOKEN
    return max(MIN_INPUT_BYTES, min(bound, memory // MEMORY_SHARE))


def read_timeout(comm_timeout: float | None) -> float:
    """Seconds a read may see no data (0: no limit): ``--comm-timeout``'s."""
    return DEFAULT_READ_TIMEOUT_S if comm_timeout is None else comm_timeout


def describe_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


class InputTooLarge(UserError):
    pass


def read_bounded(path: str, what: str, bound: int, timeout: float,
                 line_bound: int | None = None, hint: str = "") -> bytes:
    """The bytes of ``path`` ("-": standard input), at most ``bound`` of them, each line
    at most ``line_bound``; a UserError naming the file otherwise."""
    name = "standard input" if path == "-" else str(path)
    limit_hint = hint or ("the bound follows from the context (--max-context) and "
                          "--memory-limit; use a shorter input")

    def too_large(size: int | None = None, line: int | None = None):
        if line is not None:
            return InputTooLarge(f"{what} {name}: line {line} is longer than "
                                 f"{describe_bytes(line_bound)}; {limit_hint}")
        got = f" ({describe_bytes(size)})" if size is not None else ""
        return InputTooLarge(f"{what} {name} is larger than {describe_bytes(bound)}{got}; "
                             f"{limit_hint}")

    if path == "-":
        fd, close = sys.stdin.fileno(), False
        if os.isatty(fd):
            timeout = 0  # someone is typing: wait for them
    else:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise UserError(f"{what} not found: {name}") from None
        except OSError as error:
            raise UserError(f"cannot read {what} {name}: {error.strerror}") from None
        if stat.S_ISDIR(info.st_mode):
            raise UserError(f"{what} is a directory: {name}")
        if stat.S_ISREG(info.st_mode) and info.st_size > bound:
            raise too_large(info.st_size)
        try:
            # Non-blocking: opening a FIFO must not wait for its writer (select does).
            fd, close = os.open(path, os.O_RDONLY | os.O_NONBLOCK), True
        except OSError as error:
            raise UserError(f"cannot read {what} {name}: {error.strerror}") from None
    try:
        return _read_fd(fd, bound, timeout, line_bound, too_large,
                        lambda: UserError(f"{what} {name}: no data for {timeout:g} s (a FIFO "
                                          f"or pipe nobody writes to?); the wait is "
                                          f"--comm-timeout's"),
                        lambda error: UserError(f"cannot read {what} {name}: "
                                                f"{error.strerror or error}"))
    finally:
        if close:
            os.close(fd)


def _read_fd(fd: int, bound: int, timeout: float, line_bound, too_large, idle, failed) -> bytes:
    chunks, total = [], 0
    line_number, line_length = 1, 0
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], timeout if timeout > 0 else None)
        except OSError as error:
            raise failed(error) from None
        if not ready:
            raise idle()
        try:
            chunk = os.read(fd, min(CHUNK, bound + 1 - total))
        except BlockingIOError:
            continue
        except OSError as error:
            raise failed(error) from None
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > bound:
            raise too_large()
        if line_bound is not None:
            start = 0
            while True:
                newline = chunk.find(b"\n", start)
                if newline < 0:
                    line_length += len(chunk) - start
                    break
                line_length += newline - start
                if line_length > line_bound:
                    raise too_large(line=line_number)
                line_number += 1
                line_length = 0
                start = newline + 1
            if line_length > line_bound:
                raise too_large(line=line_number)
        chunks.append(chunk)


def decode_text(data: bytes, what: str, path: str) -> str:
    """UTF-8 text of ``data``, or one line naming the first bad byte (the rule for all
    text: spmd_cp/text_input.py)."""
    from ..text_input import decode_utf8

    return decode_utf8(data, f"{what} {'standard input' if path == '-' else path}")


def read_text(path: str, what: str, bound: int, timeout: float) -> str:
    """A UTF-8 text input, bounded; refused when empty."""
    text = decode_text(read_bounded(path, what, bound, timeout), what, path)
    if not text.strip():
        name = "standard input" if path == "-" else path
        raise UserError(f"{what} is empty: {name}")
    return text
