"""The one rule for text from outside: it is valid Unicode, or it is refused.

Text reaches the tokenizer from command-line arguments (``--prompt``, ``--system``,
``--stop``), files (prompts, documents, jobs files, caches' meta.json) and JSON (jobs
lines, HTTP request bodies). Python can hold text that is not valid Unicode as lone
surrogates (U+D800..U+DFFF): bytes of an argument that are not UTF-8 arrive as
U+DC80..U+DCFF (the interpreter's ``surrogateescape``), and JSON's ``"\\ud800"`` escape
decodes to one. The tokenizer refuses such a string with a TypeError deep in a rank, so
every input is checked here first, on rank 0 before the model loads (the server: before
a request is queued). It is refused, never replaced: a prompt silently changed is an
answer to a question nobody asked.

Standard library only.
"""

from __future__ import annotations

from .errors import UserError


class InvalidText(UserError):
    """Text that is not valid Unicode (one line naming where)."""


def unicode_problem(text: str) -> str | None:
    """None where ``text`` is valid Unicode, else what is wrong and where."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        at, code = error.start, ord(text[error.start])
    if 0xDC80 <= code <= 0xDCFF:  # how surrogateescape carries a byte that is not UTF-8
        return f"the byte 0x{code - 0xDC00:02X} at character {at} is not UTF-8"
    return f"a lone surrogate U+{code:04X} at character {at}"


def find_invalid_text(value, where: str = "") -> tuple[str, str] | None:
    """(where, problem) of the first string in ``value`` (strings, lists, tuples, dicts:
    their keys too) that is not valid Unicode, or None. ``where`` names ``value``; the
    answer names the string inside it, like ``messages[0].content``. Iterative: a deeply
    nested value cannot exhaust the stack."""
    stack = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = unicode_problem(item)
            if problem:
                return path, problem
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{index}]", v) for index, v in reversed(list(enumerate(item))))
        elif isinstance(item, dict):
            for key, v in reversed(list(item.items())):
                stack.append((f"{path}.{key}" if path else str(key), v))
                stack.append((f"{path} (a key)" if path else "a key", key))
    return None


def check_text(value, what: str):
    """``value`` (a string, or strings in a list) as given, or an InvalidText naming
    ``what`` (e.g. ``--prompt``) and the first character that is not valid Unicode."""
    found = find_invalid_text(value, what)
    if found is not None:
        where, problem = found
        raise InvalidText(f"{where} is not valid Unicode text: {problem}")
    return value


def decode_utf8(data: bytes, what: str) -> str:
    """The text of ``data`` read as UTF-8, or an InvalidText naming ``what`` and the
    offset of the first byte that is not UTF-8. (Python's decoder refuses encoded
    surrogates too, so what it returns is valid Unicode.)"""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidText(f"{what} is not UTF-8 text (invalid byte at offset "
                          f"{error.start})") from None
