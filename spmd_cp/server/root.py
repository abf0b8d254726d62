"""Rank 0's main-thread side of the server: take the next request off the queue, turn it
into token ids the other ranks receive, and hand the answer back to its handler thread.

Requests are prepared here, one at a time, rather than in the handler threads: the
tokenizer is then used by one thread only (rank 0's main thread also decodes the
answer's text with it).
"""

from __future__ import annotations

import dataclasses
import queue

import numpy as np

from ..config import SamplingConfig
from ..errors import UserError
from .http_api import Pending, ServerState
from .openai_api import ApiError
from .resident import Plan


@dataclasses.dataclass
class Work:
    """One request's work, as rank 0 broadcasts it to every rank."""

    ids: np.ndarray  # the prompt's token ids, whole
    sampling: SamplingConfig  # max_tokens capped to the context
    plan: Plan  # the resident entries' use
    forecast: dict  # its memory forecast (the busiest rank's, by part)
    slot_tokens: int  # batched serving: its slot's KV tokens a rank
    key: int = 0  # batched serving: the request's key
    error: str | None = None  # batched serving: set at its end where sampling failed

    @property
    def reused(self) -> int:
        return self.plan.reused


class RootSide:
    """Rank 0's share of serving: requests in, answers out, /health's figures."""

    def __init__(self, state: ServerState, loaded, run, comm, may_split,
                 buffer_cache_bytes: int = 0):
        """``may_split()``: whether decode steps run split (or may: no plan yet);
        ``buffer_cache_bytes``: the bound set on MLX's buffer cache (0: none)."""
        self.state = state
        self.loaded = loaded
        self.run = run
        self.comm = comm
        self.may_split = may_split
        self.current: Pending | None = None
        self.running: dict[int, Pending] = {}  # batched serving: the requests decoding
        self.slot_rooms: dict[int, int] = {}  # batched serving: each running request's slot
        self.slot_scale = 1.0  # a slot entry's bytes over one of the cache's (set by serve)
        self.keys = 0
        self.outside_mlx = 0  # the most any rank held outside MLX's arrays, last measured
        self.buffer_cache_bytes = buffer_cache_bytes

    def next_work(self, caches) -> Work | None:
        """The next request's work for every rank (None: shut down)."""
        self.current = None
        self.state.busy, self.state.running = False, 0
        taken = self._take(caches, wait=True)
        if taken is None:
            return None
        self.current, work = taken
        self.state.busy, self.state.running = True, 1
        return work

    def next_works(self, caches, free: int) -> list[Work] | None:
        """Batched serving: the work of the next request, which joins the running batch
        now ([] when none waits or ``free`` is 0; waiting for one while none runs);
        None: stopping with none running. One at a time: each request's plan of the
        resident caches is made after the last one's was applied. The work carries its
        ``key``; its Pending is held in ``running``."""
        taken = self._take(caches, wait=not self.running) if free > 0 else None
        if taken is not None:
            pending, work = taken
            self.keys += 1
            work.key = self.keys
            self.running[self.keys] = pending
            self.slot_rooms[self.keys] = work.slot_tokens
        self.state.busy, self.state.running = bool(self.running), len(self.running)
        if taken is None and not self.running and self.state.stopping.is_set():
            return None
        return [work] if taken is not None else []

    def _take(self, caches, wait: bool) -> tuple[Pending, Work] | None:
        """The next queued request and its work, started (None: stopping, or with
        ``wait`` False none queued). Requests whose client has gone are dropped; bad
        ones are answered here with their 4xx."""
        while not self.state.stopping.is_set():
            try:
                pending = self.state.queue.get(timeout=0.2) if wait \
                    else self.state.queue.get_nowait()
            except queue.Empty:
                if wait:
                    continue
                return None
            if pending.cancelled.is_set():
                self.state.cancelled += 1
                continue
            try:
                work = self.prepare(pending.request, caches)
            except ApiError as error:
                pending.fail(error)
                continue
            pending.start()
            return pending, work
        return None

    def ended(self, key: int, result, work: Work, caches, memory: list[dict]):
        """Batched serving: request ``key``'s answer to its handler (``result`` None:
        its sampling failed, ``error`` in work)."""
        self.current = self.running.pop(key)
        del self.slot_rooms[key]
        self.state.running = len(self.running)
        if result is None:
            self.current.fail(ApiError(400, work.error, code="invalid_value"))
            return
        self.finished(result, work, caches, memory)

    def prompt_text(self, request) -> tuple[str, list | None]:
        """(the text to tokenize, where the user's contents lie in it: None for all of
        it). Control-token strings inside a message stay text (run/prompts.py), as in
        generate, unless --parse-special."""
        from ..run.prompts import content_spans

        tokenizer = self.loaded.tokenizer
        if request.kind != "chat":
            return request.prompt, None
        if not getattr(tokenizer, "has_chat_template", False):
            return "".join(m["content"] for m in request.messages), None
        try:
            text = tokenizer.apply_chat_template(request.messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - a template's own refusal (jinja)
            raise ApiError(400, f"the chat template refused these messages: {error}",
                           code="invalid_messages", param="messages") from None
        return text, content_spans(self.loaded, request.messages, text)

    def prepare(self, request, caches) -> Work:
        """Token ids, the resident caches' plan for them (the entry continued, the tokens
        kept, the entries evicted), the sampling; checked: the context and the memory
        forecast with the resident entries kept: the busiest rank's (every part the
        most any rank holds), MLX's buffer cache at its bound included where bounded."""
        from ..run.memory import check_memory
        from ..run.prompts import cap_to_context, tokenize_checked
        from ..engine.cache.forecast import kv_tokens_per_rank
        from ..runtime.resident import outside_mlx_bytes
        from .resident import held_room

        sampling = request.sampling
        try:
            text, spans = self.prompt_text(request)
            ids = tokenize_checked(self.loaded, text, self.run.max_context, user_spans=spans,
                                   parse_special=self.run.parse_special)
        except UserError as error:
            raise ApiError(400, str(error), code="context_length_exceeded",
                           param="messages" if request.kind == "chat" else "prompt") from None
        # As generate does: an answer longer than the context leaves is cut there (its
        # finish_reason "length"), not refused for the memory it would never use.
        max_tokens = cap_to_context(sampling.max_tokens, len(ids),
                                    self.run.max_context or self.loaded.max_context,
                                    "max_tokens")
        sampling = dataclasses.replace(sampling, max_tokens=max_tokens)

        forecast = {}
        total = len(ids) + sampling.max_tokens  # the request's entry, once answered
        process = max(self.outside_mlx, outside_mlx_bytes())

        own = kv_tokens_per_rank(total, self.comm.size)
        # Batched serving: every running request's slot and this one's (a copy of its
        # entry's tokens, and its answer's), each as long as the longest.
        rooms = [*self.slot_rooms.values(), own]
        slots = int(len(rooms) * max(rooms) * self.slot_scale) \
            if self.state.max_batch > 1 else 0

        def fits(kept: int, continued: int, reused: int):
            room = held_room(kept, continued, own) + slots
            try:
                forecast.update(check_memory(
                    self.comm, self.loaded, self.run, total, len(ids) - reused,
                    split_decode=self.may_split() and sampling.max_tokens > 1,
                    process_bytes=process, held_kv_tokens=room,
                    buffer_cache_bytes=self.buffer_cache_bytes))
            except UserError as error:
                raise ApiError(400, str(error), code="memory_limit_exceeded") from None

        return Work(ids, sampling, caches.plan(ids, fits), forecast, own)

    def emit(self, text: str):
        self.current.emit(text)

    def cancelled(self) -> bool:
        # Not on shutdown: the request being answered is finished first.
        return self.current.cancelled.is_set()

    def note_memory(self, caches, memory: list[dict], forecast: dict | None = None):
        """``memory``: every rank's figures (at start, or after the request whose memory
        ``forecast`` it was): runtime/resident.py's ``memory_now``, its resident KV bytes
        and each entry's K/V room, for /health and the next forecast."""
        caches.note_rooms([rank.pop("kv_rooms") for rank in memory])
        self.outside_mlx = max(rank["resident_bytes"] - rank["mlx_active_bytes"]
                               - rank["mlx_cache_bytes"] for rank in memory)
        self.state.cache = {"entries": len(caches.entries),
                            "bytes": sum(rank["kv_bytes"] for rank in memory),
                            "tokens": int(caches.num_tokens)}
        if forecast is not None:
            self.state.memory = [{**rank, "forecast_bytes": forecast["total_bytes"]}
                                 for rank in memory]
            self.state.memory_forecast = forecast

    def finished(self, result, work: Work, caches, memory: list[dict]):
        """The answer to its handler; ``memory``: as ``note_memory``'s."""
        counts = {"prompt_tokens": len(work.ids), "completion_tokens": len(result.tokens),
                  "cached_tokens": int(work.reused)}
        self.current.done(result.text, result.finish_reason, counts)
        self.note_memory(caches, memory, work.forecast)
        self.state.served += 1
        self.state.cancelled += result.finish_reason == "cancelled"
