"""The generation loop: prefill, then rank 0 samples and every rank feeds the token back.

Rank 0 alone holds logits and samples; it broadcasts (token, finished) each step so all
ranks stop together. Text is decoded and streamed on rank 0 only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from ..config import SamplingConfig
from ..errors import UserError
from ..runtime import allocator
from .engine import Engine


class GenerationFailed(UserError):
    """Rank 0 could not sample or stream a token (settings its sampler refuses): every
    rank raises it at the same step, so a batch can record the job's error and go on."""


@dataclass
class Generation:
    """What rank 0 knows at the end of a generation (other ranks: timings only)."""

    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "cancelled"
    prefill_s: float
    decode_s: float  # the decode steps and sampling, without decode_setup_s
    decode_setup_s: float = 0.0  # readying decode (Engine.prepare_decode) this time


class IncrementalText:
    """The text of a growing token list, decoding only a few tokens at its end for each
    new one (linear in the answer's length, where decoding it all each time is quadratic).

    As the tokenizers library's DecodeStream and vLLM's detokenizer: the text a new token
    adds is decode(window + new) minus decode(window), the window being the tokens of the
    last settled piece, so a decoder that treats the first token apart (a leading space
    dropped) or a byte sequence spread over several tokens decodes as in the whole list.
    Text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD) stays ``pending``
    until a later token completes it.
    """

    def __init__(self, decode):
        self.decode = decode
        self.tokens: list[int] = []
        self.settled = ""  # text no later token changes
        self._window = 0  # the settled piece's first token
        self._read = 0  # tokens whose text is settled
        self._window_text = ""  # decode(tokens[_window:_read])
        self.pending = ""  # text of tokens[_read:], while incomplete
        self.cut_inside_character = False  # the last token left a character incomplete

    def add(self, token: int):
        self.tokens.append(token)
        text = self.decode(self.tokens[self._window:])
        extends = text.startswith(self._window_text)
        if extends and not text.endswith("\ufffd"):
            self.settled += text[len(self._window_text):]
            self.pending, self.cut_inside_character = "", False
            self._window, self._read = self._read, len(self.tokens)
            self._window_text = self.decode(self.tokens[self._window:self._read])
            return
        # An incomplete character, or a decoder that rewrote the window's end (a clean-up
        # across the boundary; a byte-fallback run, every byte of which turns to U+FFFD
        # while it is not UTF-8): wait for the next token, with a wider window.
        self.pending = text[len(self._window_text):] if extends else ""
        self.cut_inside_character = text.endswith("\ufffd")

    def complete(self) -> str:
        """The whole list's text: one decode of it all (exactly what decoding it at once
        gives), or, where it ends inside a character, the settled text and the pending
        tail's complete characters (the incomplete bytes dropped, as mlx-lm's streaming
        detokenizers drop them)."""
        if self.cut_inside_character:
            return self.settled + self.pending.rstrip("\ufffd")
        return self.decode(self.tokens)


class TextStream:
    """Decodes the answer token by token (IncrementalText) and emits only text that is
    final.

    Text that may still become part of a stop string, or an incomplete UTF-8 sequence
    (decoded as U+FFFD), is held back until the next token settles it. A stop string is
    looked for only where new text could complete one.
    """

    def __init__(self, tokenizer, stop: list[str], write=None):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.write = write
        self.emitted = 0
        self.decoded = IncrementalText(tokenizer.decode)
        self._searched = 0  # stop strings end past here, if anywhere
        self._cut: str | None = None  # the text up to a stop string, once one appeared
        self._complete: tuple[int, str] | None = None  # (tokens, their whole text)

    @property
    def text(self) -> str:
        """The answer's text (up to a stop string, once one appeared); decoded whole once
        per token count, read at the end."""
        if self._cut is not None:
            return self._cut
        if self._complete is None or self._complete[0] != len(self.decoded.tokens):
            self._complete = (len(self.decoded.tokens), self.decoded.complete())
        return self._complete[1]

    def push(self, tokens: list[int]) -> bool:
        """Take the tokens of ``tokens`` not seen yet; return True when a stop string has
        appeared."""
        for token in tokens[len(self.decoded.tokens):]:
            self.decoded.add(token)
        settled, pending = self.decoded.settled, self.decoded.pending
        if self.stop:
            start = max(0, self._searched - self.holdback)
            tail = settled[start:] + pending
            hits = [tail.find(s) for s in self.stop if s in tail]
            self._searched = len(settled)
            if hits:
                self._cut = (settled + pending)[: start + min(hits)]
                self._emit(len(self._cut), self._cut)
                return True
        # Pending text may still change; a stop string may begin in the settled text's
        # last ``holdback`` characters and end in it.
        self._emit(len(settled) - self.holdback, settled)
        return False

    def finish(self):
        text = self.text
        self._emit(len(text), text)

    def _emit(self, upto: int, text: str):
        if self.write is not None and upto > self.emitted:
            self.write(text[self.emitted:upto])
        self.emitted = max(self.emitted, upto)


def overlap_by_default(comm) -> bool:
    """Whether one rank queues decode step n+1 before token n reaches the host.

    On a GPU the device computes while the host builds the next step's graph: mlx-lm's
    generate_step overlaps for that reason. On MLX's CPU backend the host's graph building
    takes a core from the BLAS threads instead: measured here in one process, lock-step
    decoded 4-7% faster than the overlapped loop at 1K and 4K context
    (benchmarks/decode_overhead.py, MLX's decode step, docs/ALGORITHMS.md).
    Several ranks always run in lock-step: the token must be broadcast first.
    """
    return comm.size == 1 and mx.default_device() == mx.gpu


def decode_tokens(engine: Engine, cache, logits, sample, max_tokens: int,
                  overlap: bool = False, stop=None, ready=None) -> Iterator[tuple[int, bool]]:
    """Sample up to ``max_tokens`` tokens, from ``logits`` (rank 0's, of the last token
    fed) on, feeding each into ``cache`` but the last: yields (token, stopped) on every
    rank, which must all consume it to the end.

    ``sample(logits) -> mx.array`` and ``stop(token) -> bool`` run on rank 0 only;
    ``stop`` sees every token as it is sampled, and True ends the generation at that
    token (yielded with stopped=True, never fed). Lock-step (any number of ranks): rank 0
    broadcasts (token, stopped), then every rank feeds the token. ``overlap`` (one rank):
    step n+1 is queued (``mx.async_eval``) before token n reaches the host, so building a
    step's graph overlaps the previous step's compute, as in mlx-lm's generate_step.
    Tokens, cache and random stream are the same either way: a step queued after the
    token that ends the generation is rolled back. ``ready()`` (lock-step, every rank)
    runs once, after the first token is out and before the first decode step.
    """
    check_overlap(engine.comm, overlap)
    if overlap:
        return _overlapped(engine, cache, logits, sample, max_tokens,
                           stop or (lambda token: False))
    return _lockstep(engine, cache, logits, sample, max_tokens, stop or (lambda token: False),
                     ready or (lambda: None))


def check_overlap(comm, overlap: bool):
    if overlap and comm.size > 1:
        raise ValueError("overlapped decode needs one rank: the others must receive each token")


def _lockstep(engine: Engine, cache, logits, sample, max_tokens: int, stop, ready):
    comm = engine.comm
    for step in range(max_tokens):
        message = None
        if comm.rank == 0:
            try:
                token = host_token(sample, logits)
                message = (token, stop(token))
            except Exception as error:  # noqa: BLE001 - rank 0's alone: tell every rank
                message = (None, failure_text(error))
        token, stopped = comm.bcast_object(message)
        if token is None:
            raise GenerationFailed(stopped)
        yield token, stopped
        if stopped or step + 1 == max_tokens:
            return
        if step == 0:
            ready()
        logits = engine.decode_step(cache, token)


def host_token(sample, logits) -> int:
    """``sample(logits)`` as an int on rank 0 now. A greedy sampler's token of float32
    logits on the CPU is numpy's argmax (the first largest, as mx.argmax picks it): MLX's,
    one graph and evaluation a call, took 1.4-2.8 ms for a batched step's 8 rows of
    SmolLM2's 49,152 logits while every other rank waited, numpy's 0.05-0.14 ms (by hand)."""
    if getattr(sample, "greedy", False) and (isinstance(logits, np.ndarray) or (
            logits.dtype == mx.float32 and mx.default_device() == mx.cpu)):
        return int(np.argmax(np.asarray(logits)))
    return int(sample(logits if not isinstance(logits, np.ndarray) else mx.array(logits)))


def _guarded(sample):
    """``sample`` raising GenerationFailed, not whatever its sampler raised."""
    def guarded(logits):
        try:
            return sample(logits)
        except GenerationFailed:
            raise
        except Exception as error:  # noqa: BLE001 - reported as the job's error
            raise GenerationFailed(failure_text(error)) from None

    return guarded


def _failing(failure: GenerationFailed):
    def sample(logits):
        raise failure

    return sample


def failure_text(error: BaseException) -> str:
    if isinstance(error, GenerationFailed):
        return str(error)
    return "sampling failed: " + " ".join(f"{type(error).__name__}: {error}".split())[:300]


def _overlapped(engine: Engine, cache, logits, sample, max_tokens: int, stop):
    if max_tokens == 0:
        return
    token = sample(logits)
    mx.async_eval(token)
    for step in range(max_tokens):
        checkpoint = cache.checkpoint()
        queued = step + 1 < max_tokens
        if queued:
            next_token = sample(engine.decode_step(cache, token, wait=False))
            mx.async_eval(next_token)
        value = int(token.item())
        if queued:
            cache.set_token(checkpoint.num_tokens, value)
        stopped = stop(value)
        if stopped and queued:
            cache.rollback(checkpoint)  # the lock-step loop never feeds the last token
        yield value, stopped
        if stopped:
            return
        if queued:
            token = next_token


def token_sampler(options: SamplingConfig):
    """``sample(logits (V,)) -> token`` (a scalar mx.array) as ``options`` ask: mlx-lm's
    sampler over the log-probabilities, or for greedy decoding the argmax of the logits
    themselves (the same token, without a logsumexp over the vocabulary per step)."""
    if options.temp == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    sampler = make_sampler(options.temp, options.top_p, options.min_p, top_k=options.top_k)
    return lambda logits: sampler((logits - mx.logsumexp(logits, keepdims=True))[None])[0]


def generate(engine: Engine, cache, prompt_ids: np.ndarray, tokenizer, options: SamplingConfig,
             write=None, prefill_progress=None, overlap: bool | None = None,
             cancelled=None) -> Generation:
    """Prefill ``prompt_ids`` into ``cache`` and generate up to ``options.max_tokens`` tokens.

    ``overlap``: queue each decode step before the previous token reaches the host (one
    rank only; None: ``overlap_by_default``). Tokens and cache are the same either way.
    ``cancelled()`` (rank 0): asked at every sampled token; True ends the generation there
    (the server's client went away), finish_reason "cancelled".
    """
    comm = engine.comm
    if overlap is None:
        overlap = overlap_by_default(comm)
    check_overlap(comm, overlap)  # before the prefill's work
    is_root = comm.rank == 0
    sample = rank0_sampler(options, is_root)
    answer = Answer(tokenizer, options, write, cancelled) if is_root else None

    start = time.perf_counter()
    logits, _ = engine.prefill(cache, prompt_ids, progress=prefill_progress)
    prefill_s = time.perf_counter() - start

    setup = _DecodeSetup(engine)
    decode_start = time.perf_counter()
    stopped = False
    for _, stopped in decode_tokens(engine, cache, logits, sample, options.max_tokens, overlap,
                                    answer.finished if is_root else None, setup):
        pass
    decode_s = time.perf_counter() - decode_start - setup.seconds
    if not is_root:
        return Generation([], "", "stop" if stopped else "length", prefill_s, decode_s,
                          setup.seconds)
    answer.stream.finish()
    finish = "cancelled" if answer.was_cancelled else "stop" if stopped else "length"
    return Generation(answer.tokens, answer.stream.text, finish, prefill_s, decode_s,
                      setup.seconds)


def rank0_sampler(options: SamplingConfig, is_root: bool):
    """Rank 0's sampler, seeded where asked; options it cannot take (a seed out of the
    generator's range, say) give one that fails at the first token, where every rank
    learns of it (GenerationFailed)."""
    try:
        sample = _guarded(token_sampler(options))
        if is_root and options.seed is not None:
            mx.random.seed(options.seed)
        sample.greedy = options.temp == 0  # host_token may take numpy's argmax
        return sample
    except (ValueError, TypeError, OverflowError) as error:
        return _failing(GenerationFailed(failure_text(error)))


class Answer:
    """Rank 0's answer so far: the sampled tokens, their text, and why they ended."""

    def __init__(self, tokenizer, options: SamplingConfig, write, cancelled):
        self.eos = set() if options.ignore_eos else set(
            getattr(tokenizer, "eos_token_ids", None) or [])
        self.stream = TextStream(tokenizer, options.stop, write)
        self.cancelled = cancelled
        self.tokens: list[int] = []
        self.was_cancelled = False

    def finished(self, token: int) -> bool:
        """Record a sampled token; True when it ends the generation."""
        if token in self.eos:
            return True
        if self.cancelled is not None and self.cancelled():
            self.was_cancelled = True
            return True
        self.tokens.append(token)
        return self.stream.push(self.tokens)


class _DecodeSetup:
    """Decode's one-time work (the collectives, --decode-tp auto, the split step's
    slices, the native step and its library's first build), called once before the first
    decode step and timed apart (``seconds``), after the prefill's freed pages are handed
    back where jemalloc allocates (runtime/allocator.py: 2-7 ms after a 3K prompt, left
    in the decode time; nothing to do under glibc). It runs after the prefill rather than
    before: readied before the prefill, steady decode steps were 4% slower (median step
    of 5 runs each, N = 2, 3K tokens: 76.5 vs 73.5 ms; not pinned down), and after the
    first token is out it delays no text."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.seconds = 0.0

    def __call__(self):
        allocator.release_free_memory()  # the prefill's score tiles and activations
        start = time.perf_counter()
        self.engine.prepare_decode()
        self.seconds = time.perf_counter() - start
