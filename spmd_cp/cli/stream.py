"""Rank 0's streamed answer on stdout, with log lines held until the answer has ended.

Under ``mpiexec ... 2>&1`` (or on a terminal) stdout and stderr share one stream: a log
line emitted mid-answer (a warning, say) would land inside the text. Records are kept from the answer's first text
on and emitted after its final newline; if the command fails mid-answer, the open line is ended
first so the error starts on a line of its own.
"""

from __future__ import annotations

import logging
import sys


class AnswerStream:
    """``with AnswerStream(log) as answer: ... write=answer.write``; ends with a newline."""

    def __init__(self, logger: logging.Logger, out=None):
        self.logger = logger
        self.out = out if out is not None else sys.stdout
        self.held: list[logging.LogRecord] = []
        self.started = False  # text written: from now on log records wait
        self.line_open = False

    def write(self, text: str):
        if text:
            self.out.write(text)
            self.out.flush()
            self.started = True
            self.line_open = not text.endswith("\n")

    def _hold(self, record: logging.LogRecord) -> bool:
        if not self.started:
            return True
        self.held.append(record)
        return False

    def __enter__(self):
        self.logger.addFilter(self._hold)
        return self

    def __exit__(self, kind, error, trace):
        # The answer always ends with a newline; after a failure only an open line is ended.
        if kind is None or self.line_open:
            self.write("\n")
        self.logger.removeFilter(self._hold)
        held, self.held = self.held, []
        for record in held:
            self.logger.handle(record)
        return False
