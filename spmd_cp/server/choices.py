"""A request's ``n`` answers (OpenAI's choices): each a request of its own to rank 0's
main thread, sampled with its own seed (the request's seed + its index, where one is
given), their events merged on the handler's thread into one answer or one stream.

Rank 0's loops see n ordinary requests: one at a time they are answered one after
another (each after the first reads the prompt from the resident cache); with
``serve --max-batch`` they decode together. The choices share the handler's event queue;
each event names its choice. A client that leaves cancels every choice; an error in one
is the request's answer (the others are cancelled).
"""

from __future__ import annotations

import dataclasses

from .openai_api import ApiRequest, chunk, full_response, usage_chunk

SEEDS = 2**64  # mx.random.seed's range: a choice's seed wraps within it


def choice_requests(request: ApiRequest) -> list[ApiRequest]:
    """The request's n choices, each with its index and its sampling's seed."""
    seed = request.sampling.seed
    return [dataclasses.replace(
        request, index=index,
        sampling=dataclasses.replace(request.sampling,
                                     seed=None if seed is None else (seed + index) % SEEDS))
            for index in range(request.n)]


def merged_counts(counts: dict[int, dict]) -> dict:
    """Usage over the choices: the prompt once (as the first choice read it), every
    choice's completion."""
    first = counts[0]
    return {"prompt_tokens": first["prompt_tokens"], "cached_tokens": first["cached_tokens"],
            "completion_tokens": sum(c["completion_tokens"] for c in counts.values())}


def _events(handler, pendings: list):
    """The choices' events as they come until every choice is done. An error event is
    the request's answer (every choice cancelled); it, or the client leaving, ends the
    events early: the caller sees fewer choices done than asked."""
    done = 0
    while done < len(pendings):
        event = handler.next_event(pendings)
        if event is None:
            return
        if event[0] == "error":
            cancel(pendings)
            handler.send_api_error(event[1])
            return
        done += event[0] == "done"
        yield event


def answer(handler, pendings: list) -> None:
    """The whole answer, once every choice is done (or the first error)."""
    answers, counts = {}, {}
    for kind, value, index in _events(handler, pendings):
        if kind == "done":
            text, finish, counts[index] = value
            answers[index] = (text, finish)
    if len(answers) < len(pendings):
        return
    request = pendings[0].request
    handler.send_json(200, full_response(request, handler.state.model_id,
                                         [answers[i] for i in range(len(pendings))],
                                         merged_counts(counts)))


def stream(handler, pendings: list) -> None:
    """Server-sent events: each choice's role, text and finish as they come (each event
    names its choice's index), then the usage where asked, then [DONE]."""
    request, model = pendings[0].request, handler.state.model_id
    started, counts = False, {}
    for kind, value, index in _events(handler, pendings):
        if kind == "start":
            if not started:
                handler.start_events(pendings[0])
                started = True
            if request.kind == "chat":
                handler.send_event(chunk(request, model, first=True, index=index))
        elif kind == "text":
            handler.send_event(chunk(request, model, text=value, index=index))
        elif kind == "done":
            _, finish, counts[index] = value
            handler.send_event(chunk(request, model, finish_reason=finish, index=index))
    if len(counts) < len(pendings):
        return
    if request.include_usage:
        handler.send_event(usage_chunk(request, model, merged_counts(counts)))
    handler.wfile.write(b"data: [DONE]\n\n")
    handler.wfile.flush()


def cancel(pendings: list) -> None:
    for pending in pendings:
        pending.cancelled.set()
