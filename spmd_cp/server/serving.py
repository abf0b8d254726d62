"""Every rank's side of serving: the resident caches preloaded, the request loops (one
request at a time, or --max-batch requests decoded together), and the memory figures
rank 0's forecast reads. The command line's front end (cli/serve.py) builds the run and
starts the HTTP server on rank 0, then hands over to ``serve_loop`` or ``serve_batched``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import mlx.core as mx

from ..config import DecodeConfig, RunConfig, ServeConfig
from ..runtime import spmd
from .resident import BUFFER_CACHE_BYTES, ResidentCaches

# With --max-batch: a joining request's prompt is prefilled this many tokens at a time
# between the running requests' decode steps, so that their streams go on.
PREFILL_SLICE = 256


def bound_buffer_cache(compute) -> int:
    """On the CPU path, MLX's buffer cache within the bound the memory forecast counts
    (and the load's freed buffers handed back): the bound, or 0 where MLX's is kept (a
    GPU, whose allocations cost more and were not measured against a bound)."""
    if compute.gpu:
        return 0
    mx.set_cache_limit(BUFFER_CACHE_BYTES)
    mx.clear_cache()
    return BUFFER_CACHE_BYTES


def splits(engine, decode: DecodeConfig) -> bool:
    """Whether decode steps run split: the plan's layout once made, else whether it may."""
    if engine.plan is not None:
        return engine.plan.layout == "split"
    return decode.decode_tp != "off"


def serving_batch(args: ServeConfig, loaded, run: RunConfig, engine) -> int:
    """Requests decoded together: --max-batch where the engine has a batched step."""
    why = "layer-sharded weights" if getattr(loaded, "share", None) is not None else \
        "--afd" if run.afd is not None else None
    if args.max_batch > 1 and why is not None:
        if engine.comm.rank == 0:
            spmd.log.warning("--max-batch %d: %s decode one request at a time", args.max_batch,
                        why)
        return 1
    return args.max_batch


def gather_memory(comm, caches, slot_bytes: int = 0) -> list[dict] | None:
    """Every rank's memory figures (runtime/resident.py's ``memory_now``), its resident
    KV bytes (and the running requests' slots, ``slot_bytes``) and each entry's K/V room,
    on rank 0 (None elsewhere)."""
    from ..runtime.resident import memory_now

    return comm.gather_object({"kv_bytes": int(caches.nbytes + slot_bytes),
                               "kv_rooms": caches.own_rooms(), **memory_now()})


def preload(comm, engine, loaded, args: ServeConfig, metas: list[dict]):
    """Every rank: the resident caches, with the --preload-cache conversations in."""
    from ..engine.cache.prompt_cache import load_cache

    caches = ResidentCaches(engine, args.cache_entries)
    for directory, meta in zip(args.preload, metas):
        caches.add(load_cache(comm, directory, meta, loaded.checksum,
                              engine.model.num_layers, engine.model.kv_dtype,
                              loaded.config.get("vocab_size"), engine.grid))
        spmd.log.info("resident cache from %s: %d tokens", directory, caches.entries[-1].num_tokens)
    return caches


@contextmanager
def idle(comm):
    """Waiting for the next request may take hours: no --comm-timeout meanwhile."""
    watchdog = comm.watchdog
    if watchdog is None:
        yield
        return
    timeout, context = watchdog.timeout, watchdog.context
    watchdog.timeout, watchdog.context = 0, "serve: waiting for a request"
    try:
        yield
    finally:
        watchdog.timeout, watchdog.context = timeout, context


def serve_loop(comm, engine, loaded, root, caches):
    """Every rank: the next request from rank 0, answered together, until it says stop."""
    from ..engine.generation import generate
    from ..runtime.resident import reset_resident_peak

    while True:
        with idle(comm):
            work = spmd.on_root(comm, lambda: root.next_work(caches))
        if work is None:
            return
        reset_resident_peak()  # /health's resident_peak_bytes: this request's
        cache = caches.take(work.plan)
        result = generate(engine, cache, work.ids[work.reused:], loaded.tokenizer,
                          work.sampling, write=root.emit if root else None,
                          cancelled=root.cancelled if root else None)
        memory = gather_memory(comm, caches)
        if root is not None:
            spmd.log.info("request: %d prompt tokens (%d from the resident cache), %d "
                          "generated, %s; %d cache entries", len(work.ids), work.reused,
                          len(result.tokens), result.finish_reason, len(caches.entries))
            root.finished(result, work, caches, memory)


def serve_batched(comm, engine, loaded, root, caches, max_batch: int):
    """Every rank: requests decoded together (engine/scheduler.py), until rank 0 says
    stop. Before each step rank 0 hands over every queued request while slots are free.
    A joining request's short prompt is fed as rows of the next step (the native step,
    engine/scheduler.PROMPT_ROWS) and written back to its resident entry; a longer one is
    prefilled into its resident entry (as in one-at-a-time serving) PREFILL_SLICE tokens
    between two steps of the running ones. Either way the request's entries are copied
    into its slot of the batch, where its answer's keys and values go; where the native
    step runs they go back to the entry when the request ends, so that a follow-up
    reuses the whole conversation (MLX's batched step: the prompt alone)."""
    from ..engine.scheduler import Request, Scheduler
    from ..runtime.resident import reset_resident_peak

    works = {}

    def finished(request, result, error):
        work = works.pop(request.key)
        memory = gather_memory(comm, caches, scheduler.decoder.tail_bytes)
        if root is None:
            return
        work.error = error
        if result is not None:
            spmd.log.info("request: %d prompt tokens (%d from the resident cache%s), %d "
                          "generated, %s; %d running", len(work.ids), work.reused,
                          ", the rest as rows of a step" if request.as_rows else "",
                          len(result.tokens), result.finish_reason, len(scheduler.running))
        root.ended(request.key, result, work, caches, memory)

    scheduler = Scheduler(engine, engine.new_cache(), 0, loaded.tokenizer, max_batch, finished,
                          prefill_slice=PREFILL_SLICE)
    if root is not None:
        root.slot_scale = slot_scale(engine, scheduler.decoder)
    while True:
        # Every queued request joins now while slots are free, one at a time: each
        # one's plan of the resident caches is made after the last one's was applied.
        while True:
            busy = scheduler.running or scheduler.joining
            with nullcontext() if busy else idle(comm):
                joining = spmd.on_root(comm, lambda: root.next_works(caches, scheduler.free))
            if joining is None:
                return
            if joining and not busy:
                reset_resident_peak()  # /health's resident_peak_bytes: this batch's
            for work in joining:
                works[work.key] = work
                pending = root.running[work.key] if root is not None else None
                scheduler.join(Request(
                    work.key, work.ids[work.reused:], work.sampling,
                    source=caches.take(work.plan), write=pending.emit if pending else None,
                    cancelled=pending.cancelled.is_set if pending else None))
                caches.held = scheduler.sources_in_use()
            if not joining or scheduler.free <= 0:
                break
        scheduler.advance()
        caches.held = scheduler.sources_in_use()


def slot_scale(engine, decoder) -> float:
    """A batch slot's bytes per entry over the cache's (the native step's slots hold
    float32, MLX's the cache's dtype)."""
    if decoder.kind != "native":
        return 1.0
    return 4 / engine.model.kv_dtype.size
