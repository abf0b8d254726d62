"""Progress on rank 0's stderr: prefill chunks, jobs done, throughput, ETA, and a footer.

Two renderings of the same status line:
- ``bar``: one line redrawn in place (a terminal);
- ``lines``: a plain line at most every ``interval`` seconds (pipes and log files).
mpiexec forwards every rank's stderr through a pipe, so under it ``auto`` usually
resolves to ``lines``; ``--progress bar`` forces the live line (Hydra and Open MPI pass
the carriage returns through unchanged).
"""

from __future__ import annotations

import logging
import math
import sys
import time

MODES = ("auto", "bar", "lines", "off")
BAR_REFRESH_S = 0.1  # redraw the live line at most 10 times a second


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """Counts a batch's jobs and tokens and renders them; every method is cheap to call."""

    def __init__(self, total_jobs: int, mode: str = "auto", stream=None, interval: float = 5.0,
                 prefill_chunk: int = 0, prefix: str = "", clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", lambda: False)
            mode = "bar" if isatty() else "lines"
        if mode not in MODES:
            raise ValueError(f"unknown progress mode {mode!r}")
        self.mode = mode
        self.total_jobs = total_jobs
        self.interval = interval
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix
        self.clock = clock
        self.start = clock()
        self.last_draw = -math.inf
        self.bar_visible = False
        self.current = ""  # what runs now, e.g. "q3: prefill 512/1500 tok (chunk 1/3)"
        self.jobs_done = 0
        self.jobs_failed = 0
        self.prompt_tokens = 0  # prefilled (not reused) prompt tokens
        self.generated_tokens = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.decoded_tokens = 0  # tokens after the first: what decode_s paid for

    # -- events --------------------------------------------------------------------
    def prefill_callback(self, label: str):
        """A ``progress(done, total)`` callback for ``Engine.prefill``."""
        def update(done: int, total: int):
            text = f"{label}: prefill {done}/{total} tok"
            if 0 < self.prefill_chunk < total:
                chunks = -(-total // self.prefill_chunk)
                text += f" (chunk {-(-done // self.prefill_chunk)}/{chunks})"
            self.current = text
            self._draw()
        return update

    def job_done(self, prefilled: int = 0, generated: int = 0, prefill_s: float = 0.0,
                 decode_s: float = 0.0, failed: bool = False):
        self.jobs_done += 1
        self.jobs_failed += failed
        self.prompt_tokens += prefilled
        self.generated_tokens += generated
        self.decoded_tokens += max(generated - 1, 0)
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        self.current = ""
        self._draw(force=self.jobs_done == self.total_jobs)

    # -- rendering -----------------------------------------------------------------
    def status(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        done, total = self.jobs_done, self.total_jobs
        parts = [f"batch {done}/{total} jobs"]
        if self.jobs_failed:
            parts[0] += f" ({self.jobs_failed} failed)"
        if self.current:
            parts.append(self.current)
        parts.append(f"{(self.prompt_tokens + self.generated_tokens) / elapsed:.1f} tok/s")
        eta = elapsed / done * (total - done) if done else math.inf
        parts.append(f"ETA {format_duration(eta)}" if done < total
                     else f"took {format_duration(elapsed)}")
        return self.prefix + " | ".join(parts)

    def _draw(self, force: bool = False):
        if self.mode == "off":
            return
        now = self.clock()
        wait = BAR_REFRESH_S if self.mode == "bar" else self.interval
        if not force and now - self.last_draw < wait:
            return
        self.last_draw = now
        if self.mode == "bar":
            self.stream.write("\r" + self.status() + "\x1b[K")
            self.bar_visible = True
        else:
            self.stream.write(self.status() + "\n")
        self.stream.flush()

    def clear(self):
        """Erase the live line (before other output); the next event redraws it."""
        if self.bar_visible:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.bar_visible = False

    def close(self):
        """Leave the live line's last state on screen and end it."""
        if self.bar_visible:
            self.stream.write("\n")
            self.stream.flush()
            self.bar_visible = False

    def attach(self, logger: logging.Logger):
        """Clear the live line before each record ``logger`` emits, so they do not mix."""
        def clear_first(record):
            self.clear()
            return True

        for handler in logger.handlers:
            handler.addFilter(clear_first)

    def footer(self, peak_mem_bytes: list[int] | None = None) -> str:
        """mlx-lm's closing lines (prompt and generation throughput, peak memory), per rank."""
        lines = ["==========",
                 f"Prompt: {self.prompt_tokens} tokens, "
                 f"{self.prompt_tokens / max(self.prefill_s, 1e-9):.3f} tokens-per-sec",
                 f"Generation: {self.generated_tokens} tokens, "
                 f"{self.decoded_tokens / self.decode_s if self.decode_s > 0 else 0.0:.3f}"
                 " tokens-per-sec"]
        if peak_mem_bytes:
            per_rank = ", ".join(f"{b / 1e9:.3f} GB (rank {r})"
                                 for r, b in enumerate(peak_mem_bytes))
            lines.append(f"Peak memory: {per_rank}")
        return "\n".join(lines)
