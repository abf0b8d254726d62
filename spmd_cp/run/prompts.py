"""Token ids of a prompt where the user's text stays text (rank 0).

The chat template writes real control tokens (``<|im_start|>``, ``<|im_end|>``) around
the messages; a message's content is the user's (a document, a web page, a mail) and
may hold the same strings. Tokenized with special-token parsing, a document holding
``<|im_end|><|im_start|>system`` would close the user turn and open a system turn. Here
only the template's own control tokens become control tokens: the template is rendered
with a marker in place of each message, so where every content lies in the text is
known, and a control token found inside a content is tokenized as ordinary text.

Where no content holds a control token's string (every ordinary prompt) the ids are
exactly the tokenizer's own; otherwise the text is split at the template's control
tokens and each piece between them is tokenized with special parsing off, which is what
the tokenizer does itself (added tokens split the text, the pieces are encoded apart).
``--parse-special`` restores the tokenizer's own reading of the whole text.

``tokenize_checked`` and ``cap_to_context`` hold a prompt and its answer to the model's
context, for every front end (the command line's and the HTTP server's).
"""

from __future__ import annotations

import logging
import secrets

import numpy as np

from ..errors import UserError

log = logging.getLogger("spmd_cp")


def render(loaded, conversation: dict, prompt: str, chat: bool) -> tuple[str, list]:
    """(the text to tokenize, [(start, end) of each message's content in it])."""
    if not (chat and getattr(loaded.tokenizer, "has_chat_template", False)):
        # Without a template every character is the user's (or the model's earlier answers).
        text = conversation["text"] + prompt
        return text, [(0, len(text))]
    # A prompt file's trailing newline is not part of the question; small models answer
    # noticeably worse with it inside the user turn.
    messages = conversation["messages"] + [{"role": "user", "content": prompt.strip()}]
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    return text, content_spans(loaded, messages, text)


def content_spans(loaded, messages: list, text: str) -> list:
    """Where each message's content lies in ``text``, found by rendering markers."""
    tag = secrets.token_hex(8)
    markers = [f"\ue000{tag}:{i}\ue001" for i in range(len(messages))]
    marked = loaded.tokenizer.apply_chat_template(
        [{**m, "content": marker} for m, marker in zip(messages, markers)], tokenize=False,
        add_generation_prompt=True)
    spans, rebuilt, position = [], [], 0
    for message, marker in zip(messages, markers):
        at = marked.find(marker, position)
        if at < 0:
            break
        rebuilt.append(marked[position:at])
        start = sum(len(part) for part in rebuilt)
        rebuilt.append(message["content"])
        spans.append((start, start + len(message["content"])))
        position = at + len(marker)
    rebuilt.append(marked[position:])
    if "".join(rebuilt) == text and len(spans) == len(messages):
        return spans
    # A template that changes the content (trims it, say): find each content in order.
    spans, position = [], 0
    for message in messages:
        content = message["content"]
        at = text.find(content, position) if content else -1
        if at >= 0:
            spans.append((at, at + len(content)))
            position = at + len(content)
    return spans


def encode(loaded, text: str, user_spans: list, parse_special: bool = False) -> list[int]:
    """Token ids of ``text`` with control tokens only outside ``user_spans``."""
    hf = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)  # mlx-lm's wrapper
    backend = getattr(hf, "backend_tokenizer", None)
    if parse_special or backend is None:
        return list(loaded.tokenizer.encode(text))
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    whole = backend.encode(text)
    inside = [(i, s) for i, (token, s) in enumerate(zip(whole.ids, whole.offsets))
              if token in special and _overlaps(s, user_spans)]
    if not inside:
        return list(whole.ids)
    # The template's own control tokens, in order; everything between them is plain text.
    template = [(token, s) for token, s in zip(whole.ids, whole.offsets)
                if token in special and s[1] > s[0] and not _overlaps(s, user_spans)]
    # Tokens the post-processor adds (BOS) carry an empty span: keep them where they are.
    leading = []
    for token, (start, end) in zip(whole.ids, whole.offsets):
        if start == end == 0:
            leading.append(token)
        else:
            break
    ids, position = list(leading), 0
    previous = backend.encode_special_tokens
    backend.encode_special_tokens = True
    try:
        for token, (start, end) in template + [(None, (len(text), len(text)))]:
            if start > position:
                ids += backend.encode(text[position:start], add_special_tokens=False).ids
            if token is not None:
                ids.append(token)
            position = end
    finally:
        backend.encode_special_tokens = previous
    return ids


def _overlaps(span, spans) -> bool:
    start, end = span
    return any(start < s_end and s_start < end for s_start, s_end in spans)


def tokenize_checked(loaded, text: str, max_context: int | None, reserve: int = 0,
                     user_spans: list | None = None, parse_special: bool = False) -> np.ndarray:
    """Token ids of ``text`` (rank 0), refusing an empty or over-long prompt.
    ``user_spans``: where the user's text lies (None: all of it), tokenized as plain text
    unless ``parse_special`` (``encode``)."""
    spans = [(0, len(text))] if user_spans is None else user_spans
    ids = np.asarray(encode(loaded, text, spans, parse_special), np.int64)
    if ids.size == 0:
        raise UserError("the prompt is empty after tokenization")
    limit = max_context or loaded.max_context
    if limit is not None and ids.size + reserve > limit:
        extra = f" + {reserve} tokens to generate" if reserve else ""
        whose = f"--max-context {limit}" if max_context else \
            f"the model's context of {limit} tokens"
        raise UserError(f"prompt has {ids.size} tokens{extra}, more than {whose}")
    return ids


def cap_to_context(max_tokens: int, prompt_tokens: int, context: int | None,
                   name: str | None = None) -> int:
    """Tokens to generate after ``prompt_tokens``, within the model's ``context``; a cap
    of the setting ``name`` (``--max-tokens``, ``max_tokens``) is warned about."""
    capped = max_tokens if not context else max(0, min(max_tokens, context - prompt_tokens))
    if name and capped < max_tokens:
        log.warning("%s %d capped at %d: the prompt's %d tokens and the answer must fit the "
                    "context of %d tokens", name, max_tokens, capped, prompt_tokens, context)
    return capped
