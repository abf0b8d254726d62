"""Many sequences after one shared prefix, decoded together (batched_decode.py).

The policy, on every rank in lock-step:

    join     while fewer than ``max_batch`` sequences decode or join, the next request
             queues to join;
    admit    the joining requests' prompts, in turn: a short one (PROMPT_ROWS tokens at
             most) as rows of the next step where the step takes them (the native
             batched step: each row sees the prefix and the rows before it), several
             short ones in one step, PROMPT_ROWS rows in all while others decode; a longer
             one prefilled by the engine onto the prefix cache (a slice at a time between
             the running sequences' steps where ``prefill_slice`` says), its tail then
             moved into a slot of the batch (the prefix cache back at the prefix). Rank 0
             samples its first token from its last row's logits;
    step     one batched decode step feeds every running sequence its last token; rank 0
             samples each one's next token with that sequence's own settings;
    retire   a sequence that stopped (EOS, a stop string, ``max_tokens``) leaves at once
             and its slot is free for the next request.

Requests are admitted in order. The server gives each request a cache of its own (its
resident conversation: copied into the slot whole and kept; where the native step runs,
a prompt fed as rows is written back to it, and the answer's entries when it ends).
Rank 0 broadcasts every decision (a token, whether it stopped, or a sampling failure),
so all ranks admit, step and retire the same sequences.

Random sampling draws from MLX's one random stream, in the order the rows are sampled:
a seeded job's text is the same run to run for the same jobs and ``max_batch``, but not
the text it gets alone (greedy decoding gets the same tokens either way).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..config import SamplingConfig
from .generation import Generation, Answer, failure_text, host_token, rank0_sampler

# A joining request's prompt of at most this many tokens is fed as rows of the running
# sequences' next step where the step takes them (the native batched step), the first
# joining prompts together up to this many rows; a longer one is prefilled on its own
# (the engine's prefill, in slices between the steps). The embedded SmolLM2 at N = 2,
# two prompts of the same length in one step against each prefilled alone (the 2-core
# AMD EPYC, batch --json's ttft_s, by hand): 15 tokens 0.11-0.13 s against 2 x 0.09-0.16,
# 41 tokens 0.20-0.22 against 2 x 0.16-0.19; from about 160 tokens on, the same.
PROMPT_ROWS = 64


@dataclass
class Request:
    """One sequence to answer: its own token ids after the shared prefix (or after what
    its own ``source`` cache holds), and rank 0's hooks: ``write(text)`` as its answer
    grows, ``cancelled()`` asked at every token (True ends it, "cancelled")."""

    key: object
    ids: np.ndarray
    sampling: SamplingConfig
    source: object = None  # a ShardedKVCache of its own, kept whole (the server's entry)
    write: object = None
    cancelled: object = None
    as_rows: bool = False  # its prompt was fed as rows of a step (the scheduler's record)


@dataclass
class BatchStats:
    """What the decode steps did: their count and time, the tokens they produced, and
    how many steps ran at each batch size."""

    steps: int = 0
    step_s: float = 0.0
    tokens: int = 0
    sizes: Counter = field(default_factory=Counter)
    prompts_as_rows: int = 0  # requests whose prompts were fed as rows of a step
    tail_tokens: int = 0  # the most entries this rank's slots held at once
    tail_bytes: int = 0  # the most bytes this rank's slots took at once


@dataclass
class _Joining:
    request: Request
    done: int = 0  # its tokens prefilled so far
    prefill_s: float = 0.0


@dataclass
class _Running:
    request: Request
    token: int  # the last sampled token, fed at the next step
    produced: int  # tokens sampled so far
    prefill_s: float
    started: float  # when its decode began (perf_counter)
    answer: Answer | None  # rank 0's
    sample: object
    fed: list[int] = field(default_factory=list)  # the tokens its decode steps fed


class Scheduler:
    """Admits, steps and retires sequences after the prefix ``cache`` holds (its first
    ``prefix_tokens`` positions), at most ``max_batch`` at once.

    ``finished(request, generation, error)`` runs on every rank as each sequence ends
    (rank 0's generation holds the tokens and text; the others' timings only; ``error``
    a message where sampling failed, generation None then).
    """

    def __init__(self, engine, cache, prefix_tokens: int, tokenizer, max_batch: int,
                 finished, prefill_progress=None, prefill_slice: int = 0):
        """``prefill_slice``: the tokens of a joining request's prompt (``join``)
        prefilled between two steps while others decode (0: all of it)."""
        self.engine, self.comm = engine, engine.comm
        self.cache, self.prefix_tokens = cache, prefix_tokens
        self.tokenizer, self.max_batch = tokenizer, max(1, max_batch)
        self.finished, self.prefill_progress = finished, prefill_progress
        self.decoder = engine.batched_decoder(cache, prefix_tokens)
        self.running: dict[str, _Running] = {}
        self.joining: list[_Joining] = []
        self.prefill_slice = prefill_slice
        self.stats = BatchStats()

    def run(self, requests: list[Request]):
        """Answer every request (each ``finished`` once); returns the BatchStats."""
        waiting = list(reversed(requests))
        while waiting or self.running or self.joining:
            while waiting and self.free > 0:
                self.join(waiting.pop())
            self.advance()
        return self.stats

    @property
    def free(self) -> int:
        """Sequences that may join before the batch is full."""
        return self.max_batch - len(self.running) - len(self.joining)

    def join(self, request: Request):
        """Queue ``request``: ``advance`` feeds it to the batch, in turn (its prompt as
        rows of a step, or prefilled ``prefill_slice`` tokens at a time between the
        running sequences' steps), and samples its first token."""
        self.joining.append(_Joining(request))

    def advance(self):
        """One step of the running sequences, with the short prompts of the first joining
        requests as rows of it where the step takes them (``PROMPT_ROWS``); else one
        slice of the first joining request's prefill (all that is left where no
        sequence decodes), then the step."""
        prompts = self._prompts_as_rows()
        if prompts or not self.joining:
            if self.running or prompts:
                self.step(prompts)
            return
        joining, slice_ = self.joining[0], self.prefill_slice
        ids = joining.request.ids
        size = len(ids) - joining.done
        if self.running and slice_ > 0:
            size = min(size, slice_)
        whole = size == len(ids)  # (a progress display follows a whole prompt's prefill)
        progress = self.prefill_progress(joining.request.key) \
            if whole and self.prefill_progress else None
        start = time.perf_counter()
        logits, _ = self.engine.prefill(self._cache_of(joining.request),
                                        ids[joining.done:joining.done + size], progress=progress)
        joining.prefill_s += time.perf_counter() - start
        joining.done += size
        if joining.done == len(ids):
            self.joining.pop(0)
            self._prefilled(joining.request, logits, joining.prefill_s)
        if self.running:
            self.step()

    def _prompts_as_rows(self) -> list[Request]:
        """The first joining requests whose prompts the next step takes as rows (the
        native step's; each of PROMPT_ROWS tokens at most, as many in all while others
        decode), each admitted into the batch now."""
        if not getattr(self.decoder, "takes_prompts", False):
            return []
        taken, rows = [], 0
        budget = PROMPT_ROWS if self.running else PROMPT_ROWS * self.max_batch
        while self.joining:
            request = self.joining[0].request
            size = len(request.ids)
            if not 0 < size <= min(PROMPT_ROWS, budget - rows) or \
                    request.sampling.max_tokens == 0:
                break
            self.joining.pop(0)
            request.as_rows = True
            self.stats.prompts_as_rows += 1
            self.decoder.admit(request.key, size + request.sampling.max_tokens, request.source,
                               record=self._writes_back(request))
            taken.append(request)
            rows += size
        return taken

    def _cache_of(self, request: Request):
        return self.cache if request.source is None else request.source

    def _prefilled(self, request: Request, logits, prefill_s: float):
        """After a request's prefill: its first token sampled, and it joins the batch
        (or ends there)."""
        running = self._new_running(request, prefill_s)
        if request.sampling.max_tokens == 0:
            self._end(running, stopped=False, error=None, admitted=False)
            return
        self._started(running, *self._decide([(running, logits)])[0], admitted=False)

    def _new_running(self, request: Request, prefill_s: float) -> _Running:
        is_root = self.comm.rank == 0
        options = request.sampling
        answer = Answer(self.tokenizer, options, request.write, request.cancelled) \
            if is_root else None
        return _Running(request, -1, 0, prefill_s, time.perf_counter(), answer,
                        rank0_sampler(options, is_root))

    def _started(self, running: _Running, token: int, stopped: bool, error: str | None,
                 admitted: bool):
        """A sequence's first token decided: it decodes from the next step on (admitted
        into the batch now, unless its prompt's rows did), or ends here."""
        request = running.request
        running.token, running.produced = token, 1
        if admitted:
            self.running[request.key] = running
        if error is not None or stopped or request.sampling.max_tokens == 1:
            self._end(running, stopped, error, admitted=admitted)
            return
        if not admitted:
            self.decoder.admit(request.key, request.sampling.max_tokens, request.source,
                               record=self._writes_back(request))
            self.running[request.key] = running

    def sources_in_use(self) -> set[int]:
        """The id()s of the requests' own caches that joining requests are still fed
        into or running ones write back to (a server's resident entries: no other
        request may continue one in place or evict it meanwhile)."""
        return {id(j.request.source) for j in self.joining if j.request.source is not None} \
            | {id(r.request.source) for r in self.running.values()
               if self._writes_back(r.request)}

    def _writes_back(self, request: Request) -> bool:
        """Whether the request's rows go back to its own cache (a server's resident entry:
        its next request continues after its answer) where the step can write them."""
        return request.source is not None and getattr(self.decoder, "takes_prompts", False)

    def step(self, prompts: list[Request] = ()):
        """One batched decode step of every running sequence (and the rows of
        ``prompts``, admitted: each one's first token sampled from its last row); those
        that end leave."""
        keys = list(self.running)
        start = time.perf_counter()
        logits = self._step_rows(keys, prompts)
        host = _host_rows(logits)
        running = [self.running[k] for k in keys]
        took = time.perf_counter() - start
        started = [self._new_running(request, took) for request in prompts]
        decisions = self._decide([(r, _row(logits, host, b, r.sample))
                                  for b, r in enumerate(running + started)])
        if keys:
            self.stats.step_s += time.perf_counter() - start
            self.stats.steps += 1
            self.stats.sizes[len(keys)] += 1
        self.stats.tail_tokens = max(self.stats.tail_tokens, self.decoder.tail_tokens)
        self.stats.tail_bytes = max(self.stats.tail_bytes, self.decoder.tail_bytes)
        for one, (token, stopped, error) in zip(running, decisions):
            one.fed.append(one.token)
            if error is None:
                self.stats.tokens += 1
                one.token, one.produced = token, one.produced + 1
            if error is not None or stopped or one.produced == one.request.sampling.max_tokens:
                self._end(one, stopped, error, admitted=True)
        for one, decision in zip(started, decisions[len(running):]):
            self._started(one, *decision, admitted=True)

    def _step_rows(self, keys: list, prompts: list[Request]):
        """The step: the running sequences' last tokens, then each prompt's tokens (its
        rows written back to its resident entry after); the logits of the running rows
        and of each prompt's last row."""
        hook = self.engine.layer_hook("decode")
        tokens = [self.running[k].token for k in keys]
        if not prompts:
            return self.decoder.step(keys, tokens, hook)
        wanted, row_keys = list(range(len(keys))), list(keys)
        for request in prompts:
            row_keys += [request.key] * len(request.ids)
            tokens += [int(t) for t in request.ids]
            wanted.append(len(row_keys) - 1)
        logits = self.decoder.step(row_keys, tokens, hook, wanted)
        for request in prompts:
            if self._writes_back(request):
                self.decoder.write_back(request.key, request.source, request.ids)
        return logits

    def _decide(self, rows) -> list[tuple[int, bool, str | None]]:
        """Rank 0 samples each row's next token; every rank gets (token, stopped,
        error) per row."""
        decisions = None
        if self.comm.rank == 0:
            decisions = []
            for running, logits in rows:
                try:
                    token = host_token(running.sample, logits)
                    decisions.append((token, running.answer.finished(token), None))
                except Exception as error:  # noqa: BLE001 - this sequence's alone
                    decisions.append((-1, False, failure_text(error)))
        return self.comm.bcast_object(decisions)

    def _end(self, running: _Running, stopped: bool, error: str | None, admitted: bool):
        key = running.request.key
        if admitted:
            if running.fed and self._writes_back(running.request):
                self.decoder.write_back(key, running.request.source, np.array(running.fed))
            self.decoder.retire(key)
            del self.running[key]
        elif running.request.source is None:
            self.cache.truncate(self.prefix_tokens)
        if error is not None:
            self.finished(running.request, None, error)
            return
        decode_s = time.perf_counter() - running.started if admitted else 0.0
        tokens, text, answer = [], "", running.answer  # (rank 0's answer; none elsewhere)
        finish = "stop" if stopped else "length"
        if answer is not None:
            answer.stream.finish()
            tokens, text = answer.tokens, answer.stream.text
            finish = "cancelled" if answer.was_cancelled else finish
        self.finished(running.request, Generation(tokens, text, finish, running.prefill_s,
                                                  decode_s), None)


def _host_rows(logits):
    """A step's float32 logits on the CPU (rank 0's) as one numpy view, whose greedy rows
    take numpy's argmax (generation.host_token); None for any other."""
    if isinstance(logits, mx.array) and logits.dtype == mx.float32 and \
            mx.default_device() == mx.cpu:
        return np.asarray(logits)
    return None


def _row(logits, host, b: int, sample):
    """Row ``b`` of a step's logits for ``sample``: the numpy view's for a greedy sampler
    where there is one, else MLX's (a sampler's own ops, no copy made for it)."""
    if logits is None:
        return None
    return host[b] if host is not None and getattr(sample, "greedy", False) else logits[b]
