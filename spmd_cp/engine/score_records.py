"""What `score` gathers on rank 0: per predicted position, the token, its
log-probability and the argmax, from every rank's rows of every prefill chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ScoreRecords:
    """Per predicted position: the token, its log-probability and the argmax (rank 0)."""

    pos: list = field(default_factory=list)
    token: list = field(default_factory=list)
    logprob: list = field(default_factory=list)
    argmax: list = field(default_factory=list)

    def extend(self, parts):
        for part in parts:
            for name in ("pos", "token", "logprob", "argmax"):
                getattr(self, name).extend(part[name].tolist())

    def sort(self):
        order = np.argsort(self.pos, kind="stable")
        for name in ("pos", "token", "logprob", "argmax"):
            setattr(self, name, [getattr(self, name)[i] for i in order])
