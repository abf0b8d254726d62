"""Test-only fault injection, so failure handling is tested on real runs (the hidden
flag ``--fault SPEC`` of the commands that run the model, RunConfig.fault):

    --fault raise:rank=1:phase=prefill:layer=3   raise RuntimeError there
    --fault kill:rank=2:phase=decode:layer=0     SIGKILL this process there
    --fault hang:rank=1:phase=prefill:layer=5    stop responding (sleep)

``phase`` is prefill or decode; the fault fires the first time that rank reaches that
layer in that phase. Unset (the normal case), nothing is installed.
"""

from __future__ import annotations

import os
import signal
import time

ACTIONS = ("raise", "kill", "hang")


def parse_fault(spec: str | None) -> dict | None:
    if not spec:
        return None
    action, *fields = spec.split(":")
    fault = dict(field.split("=", 1) for field in fields)
    if action not in ACTIONS or set(fault) != {"rank", "phase", "layer"}:
        raise ValueError(f"bad --fault {spec!r}: want ACTION:rank=R:phase=P:layer=L "
                         f"with ACTION in {ACTIONS}")
    return {"action": action, "rank": int(fault["rank"]), "phase": fault["phase"],
            "layer": int(fault["layer"])}


def layer_hook(rank: int, watchdog=None, spec: str | None = None):
    """``on_layer(phase, index)`` for the engine: keeps the watchdog's context current
    and fires the configured fault, if any."""
    fault = parse_fault(spec)
    if fault is not None and fault["rank"] != rank:
        fault = None

    def on_layer(phase: str, index: int):
        if watchdog is not None:
            watchdog.context = f"{phase} layer {index}"
        if fault and fault["phase"] == phase and fault["layer"] == index:
            action = fault["action"]
            if action == "raise":
                raise RuntimeError(f"injected fault on rank {rank} at {phase} layer {index}")
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1e6)  # hang

    return on_layer
