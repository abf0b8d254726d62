"""The OpenAI API's request checking and response shapes (standard library only).

A request body is checked whole before it is queued: a field the server reads with the
wrong type or out of range is a 400 with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; fields it does not read (``user``,
``logit_bias``, ...) are ignored, as most OpenAI-compatible servers do. A body nested
deeper than ``MAX_JSON_DEPTH`` or holding text that is not valid Unicode is refused too.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from ..config import SamplingConfig, describe_range, in_range
from ..text_input import find_invalid_text

ROLES = ("system", "developer", "user", "assistant")
# Deepest nesting of arrays and objects a body may have (a request needs 4: the body,
# messages, a message, its content parts). Deeper bodies are refused, parsed or not.
MAX_JSON_DEPTH = 64


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.code, self.param = code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ApiRequest:
    """A checked request: what to prompt with, how to sample, how to answer."""

    kind: str  # "chat" or "completion"
    sampling: SamplingConfig
    messages: list[dict] | None = None  # chat: {"role", "content"} with text content
    prompt: str | None = None  # completion: the text, fed as is
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    n: int = 1  # choices: answers to the one prompt, each sampled as a request of its own
    index: int = 0  # this choice's, where the request is one of n
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object whose every string (keys too) is valid Unicode: the
    rule for all text (spmd_cp/text_input.py), so the tokenizer never meets a lone
    surrogate (``"\\ud800"``) and the whole body is checked in one place."""
    too_deep = ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} "
                             f"levels", code="invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}",
                       code="invalid_json") from None
    except RecursionError:  # the parser's own bound, far deeper than ours
        raise too_deep from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not "
                            f"{type(body).__name__}", code="invalid_json")
    invalid = find_invalid_text(body)
    if invalid is not None:
        where, problem = invalid
        raise ApiError(400, f"'{where}' is not valid Unicode text: {problem}",
                       code="invalid_value", param=where)
    return body


def json_depth(value) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _invalid(param: str, must_be: str, value) -> ApiError:
    shown = json.dumps(value)[:60]
    return ApiError(400, f"'{param}' must be {must_be}, got {shown}", code="invalid_value",
                    param=param)


# request field -> (SamplingConfig field, integer?)
NUMBERS = {"max_tokens": ("max_tokens", True), "max_completion_tokens": ("max_tokens", True),
           "temperature": ("temp", False), "top_p": ("top_p", False),
           "seed": ("seed", True)}


def parse_sampling(body: dict, defaults: SamplingConfig) -> SamplingConfig:
    """The request's sampling settings over the server's defaults."""
    settings = {name: getattr(defaults, name)
                for name in ("max_tokens", "temp", "top_p", "top_k", "min_p", "seed")}
    for param, (setting, integer) in NUMBERS.items():
        value = body.get(param)
        if value is None:
            continue
        if not (_is_int(value) if integer else _is_number(value)) or not in_range(setting, value):
            kind = "an integer" if integer else "a number"
            raise _invalid(param, f"{kind} {describe_range(setting)}", value)
        settings[setting] = value
    stop = body.get("stop")
    if stop is None:
        stop = list(defaults.stop)
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _invalid("stop", "a string or a list of strings", stop)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is None:
        ignore_eos = defaults.ignore_eos
    elif not isinstance(ignore_eos, bool):
        raise _invalid("ignore_eos", "true or false", ignore_eos)
    return SamplingConfig(**settings, stop=stop, ignore_eos=ignore_eos)


# The most choices one request may ask for (``n``): each is a sequence of its own.
MAX_CHOICES = 16


def parse_choices(body: dict) -> int:
    """``n``: how many answers to the one prompt (1 to MAX_CHOICES)."""
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise _invalid("n", f"an integer from 1 to {MAX_CHOICES}", n)
    return n


def _text_content(content, index: int) -> str:
    """A message's content as text: a string, or a list of {"type": "text"} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _invalid(f"messages[{index}].content", "a string or a list of text parts", content)


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "a non-empty list of messages", messages)
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid(f"messages[{index}]", "an object", message)
        role = message.get("role")
        if role not in ROLES:
            raise _invalid(f"messages[{index}].role", f"one of {', '.join(ROLES)}", role)
        role = "system" if role == "developer" else role
        checked.append({"role": role, "content": _text_content(message.get("content"), index)})
    return checked


def parse_prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _invalid("prompt", "a string (or a list of one string)", prompt)
    if not prompt:
        raise ApiError(400, "the prompt is empty", code="invalid_value", param="prompt")
    return prompt


def parse_request(kind: str, body: dict, defaults: SamplingConfig) -> ApiRequest:
    """Check a /v1/chat/completions ("chat") or /v1/completions ("completion") body."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "a string", model)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "true or false", stream)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _invalid("stream_options", 'an object like {"include_usage": true}', options)
    request = ApiRequest(kind, parse_sampling(body, defaults), stream=stream,
                         include_usage=options.get("include_usage", False), model=model,
                         n=parse_choices(body))
    if kind == "chat":
        request.messages = parse_messages(body.get("messages"))
    else:
        request.prompt = parse_prompt(body.get("prompt"))
    return request


# -- responses -------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _head(request: ApiRequest, model: str, chunk: bool) -> dict:
    chat = request.kind == "chat"
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": ("chatcmpl-" if chat else "cmpl-") + request.id, "object": kind,
            "created": request.created, "model": request.model or model}


def _finish(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


def full_response(request: ApiRequest, model: str, answers: list[tuple[str, str]],
                  counts: dict) -> dict:
    """The whole answer of a non-streaming request: ``answers``, (text, finish reason)
    of each choice in index order."""
    choices = []
    for index, (text, finish_reason) in enumerate(answers):
        if request.kind == "chat":
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        choices.append({**choice, "logprobs": None, "finish_reason": _finish(finish_reason)})
    return {**_head(request, model, False), "choices": choices, "usage": usage(**counts)}


def chunk(request: ApiRequest, model: str, text: str | None = None,
          finish_reason: str | None = None, first: bool = False, index: int = 0) -> dict:
    """One server-sent event of a streaming answer (choice ``index``'s)."""
    if request.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else (
            {"content": text} if text is not None else {})
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": _finish(finish_reason)}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None,
                  "finish_reason": _finish(finish_reason)}
    return {**_head(request, model, True), "choices": [choice]}


def usage_chunk(request: ApiRequest, model: str, counts: dict) -> dict:
    """The last event when stream_options.include_usage: no choices, the usage."""
    return {**_head(request, model, True), "choices": [], "usage": usage(**counts)}
