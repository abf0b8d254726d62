"""Per-rank timelines merged into one Chrome trace file (opens in Perfetto / chrome://tracing).

``--trace trace.json`` on any command records, on every rank:
- a span per prefill chunk and per decode step, and per layer inside them (the layer is
  evaluated before its span closes, so the span is that layer's real cost);
- every blocking communication call ("wait: Allgatherv", "wait: ring Sendrecv", ...);
- every ring transfer on the communication thread, from post to completion.

A straggler rank shows as the one whose peers wait; communication that is not hidden
shows as wait spans under the layers. Clocks are aligned with a barrier at start-up
(good to about one link latency across hosts). ``spmd-cp trace-summary trace.json``
prints each rank's compute and wait shares and names the slowest rank.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from contextlib import contextmanager, nullcontext


class Tracer:
    def __init__(self, rank: int):
        self.rank = rank
        self.events = []
        self.origin = time.perf_counter()
        self._lock = threading.Lock()  # the communication thread records too

    def align(self, comm):
        """Common time zero: the moment every rank leaves one barrier."""
        comm.barrier()
        self.origin = time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def complete(self, name: str, category: str, start: float, end: float, thread: int = 0,
                 **args):
        event = {"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": thread,
                 "ts": self._us(start), "dur": round((end - start) * 1e6, 1)}
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    @contextmanager
    def span(self, name: str, category: str, thread: int = 0, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, category, start, time.perf_counter(), thread, **args)

    def write(self, comm, path: str):
        """Gather every rank's events to rank 0 and write one trace file (collective)."""
        gathered = comm.gather_object(self.events)
        if comm.rank != 0:
            return
        events = []
        for rank, rank_events in enumerate(gathered):
            events.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"rank {rank}"}})
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1,
                           "args": {"name": "communication thread"}})
            events.extend(rank_events)
        # Like every other output: a temporary file renamed over the path (the path
        # was checked and claimed before the run).
        from .files import write_text_atomically

        write_text_atomically(path, [json.dumps({"traceEvents": events,
                                                 "displayTimeUnit": "ms"})])


def span(tracer: Tracer | None, name: str, category: str, **args):
    """``tracer.span(...)``, or nothing when not tracing."""
    return nullcontext() if tracer is None else tracer.span(name, category, **args)


def summarize(path: str) -> str:
    """Per-rank compute and communication-wait shares of a trace, and the slowest rank."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    if not ranks:
        raise ValueError("no spans in the trace")
    rows, compute = [], {}
    for rank in ranks:
        mine = [e for e in events if e.get("ph") == "X" and e["pid"] == rank and e["tid"] == 0]
        layer_spans = sorted((e for e in mine if e["cat"] == "layer"), key=lambda e: e["ts"])
        layers = sum(e["dur"] for e in layer_spans)
        waits = sum(e["dur"] for e in mine if e["cat"] == "wait")
        layer_waits = sum(e["dur"] for e in mine if e["cat"] == "wait"
                          and _inside(e, layer_spans))
        busy = layers - layer_waits
        compute[rank] = busy
        total = sum(e["dur"] for e in mine if e["cat"] in ("prefill", "decode")) or 1.0
        rows.append(f"rank {rank}: {total / 1e6:8.3f} s in prefill/decode, compute "
                    f"{100 * busy / total:5.1f}%, waiting {100 * layer_waits / total:5.1f}% "
                    f"(all waits {waits / 1e6:.3f} s)")
    slowest = max(compute, key=compute.get)
    fastest = min(compute, key=compute.get)
    gap = (compute[slowest] - compute[fastest]) / max(compute[fastest], 1.0)
    rows.append(f"slowest rank: {slowest} ({100 * gap:.0f}% more compute than rank {fastest})")
    return "\n".join(rows)


def _inside(event, sorted_spans) -> bool:
    """Whether ``event`` lies within one of the non-overlapping, start-sorted spans."""
    index = bisect.bisect_right([s["ts"] for s in sorted_spans], event["ts"]) - 1
    if index < 0:
        return False
    span_ = sorted_spans[index]
    return event["ts"] + event["dur"] <= span_["ts"] + span_["dur"] + 1
