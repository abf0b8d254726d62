"""`spmd-cp serve`: load the model once on every rank and answer OpenAI API requests.

    mpiexec -n 2 spmd-cp serve --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hello"}]}'

Rank 0 runs the HTTP server (spmd_cp/server) in threads that queue requests; its main
thread takes one request at a time, tokenizes it and broadcasts the work; every rank then
runs the same prefill and decode as `generate`, and rank 0 streams the text back. With
--max-batch B, up to B requests decode together (``serve_batched``): each joins the
running batch when its prefill is done and leaves at its end (every rank's serving
loops: server/serving.py). The
sharded KV caches of the last few conversations stay on the ranks (server/resident.py):
the next request prefills only what follows the longest token prefix it shares with
one. SIGTERM or SIGINT: the request being answered is finished, queued ones get 503,
and every rank exits 0. A rank that dies ends every rank (the launcher's doing); the
clients then waiting get a 503 from the guardian process (server/guardian.py).
See docs/SERVE.md.
"""

from __future__ import annotations

import signal
import sys

import click

from ..config import DecodeConfig, RunConfig, SamplingConfig, ServeConfig, from_options
from .generate import refuse_other_model
from .options import common_options, decode_options, ranged_option, sampling_options

REPEAT_S = 2.0  # signals this close to the first are the same stop request


@click.command()
@common_options
@click.option("--host", default=ServeConfig.default("host"), show_default=True,
              help="Address to listen on (anything but loopback: give --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=ServeConfig.default("port"),
              show_default=True, help="TCP port (0: any free port, logged).")
@click.option("--api-key", default=None, envvar="SPMD_CP_API_KEY",
              help="Require 'Authorization: Bearer KEY' (also from SPMD_CP_API_KEY).")
@click.option("--cache-entries", type=click.IntRange(min=1),
              default=ServeConfig.default("cache_entries"), show_default=True,
              help="Conversations whose KV cache stays on the ranks (least recently used "
                   "go first; --memory-limit bounds them too).")
@click.option("--preload-cache", "preload", multiple=True, metavar="DIR",
              help="Start with a conversation saved by `generate --save-cache` resident "
                   "(same model and rank count; repeatable).")
@click.option("--max-batch", type=click.IntRange(min=1),
              default=ServeConfig.default("max_batch"), show_default=True,
              help="Requests decoded together: a request joins the running batch after "
                   "its prefill and leaves at its end (1: one request at a time).")
@click.option("--model-name", default=None,
              help="The model id /v1/models lists (default: the model file's name).")
@sampling_options
@ranged_option("--seed", "seed", int,
               "Default seed of requests that give none (default: unseeded).")
@decode_options
def serve(**options):
    """Serve the model over an OpenAI-compatible HTTP API (rank 0 listens)."""
    from .steps import run_spmd

    options["stop"] = ()
    settings = from_options(options, RunConfig, SamplingConfig, DecodeConfig, ServeConfig)
    sys.exit(run_spmd(serve_command, *settings))


def serve_command(comm, run: RunConfig, sampling: SamplingConfig, decode: DecodeConfig,
                  args: ServeConfig):
    from pathlib import Path

    from ..engine.startup import warm_up
    from ..run.builder import RunBuilder
    from ..runtime import spmd
    from ..server import http_api
    from ..server.serving import (bound_buffer_cache, gather_memory, preload, serve_batched,
                                  serve_loop, serving_batch, splits)

    held = {}  # rank 0's server: objects that do not travel in a broadcast
    spmd.on_root(comm, open_server, args, sampling, held)
    state = held.get("state")
    catch_signals(comm, state)
    try:
        metas = spmd.on_root(comm, read_preloads, args)
        builder = RunBuilder(comm, run, decode)
        checksum = builder.check().checksum
        for directory, meta in zip(args.preload, metas):
            spmd.on_root(comm, refuse_other_model, meta, directory, checksum)
        loaded, engine = builder.load(), builder.engine()
        run = builder.run  # settled
        warm_up(engine)
        buffer_cache = bound_buffer_cache(engine.model.compute)
        caches = preload(comm, engine, loaded, args, metas)
        memory = gather_memory(comm, caches)
        max_batch = serving_batch(args, loaded, run, engine)
        root = None
        if comm.rank == 0:
            from ..server.root import RootSide

            state.model_id = args.model_name or Path(loaded.path).stem
            root = RootSide(state, loaded, run, comm, lambda: splits(engine, decode),
                            buffer_cache)
            root.note_memory(caches, memory)
            state.max_batch = max_batch
            state.ready.set()
            host, port = held["server"].server_address[:2]
            spmd.log.info("serving %s on http://%s:%d/v1 (%d ranks, %d requests at once)",
                           state.model_id, host, port, comm.size, max_batch)
        if max_batch > 1:
            serve_batched(comm, engine, loaded, root, caches, max_batch)
        else:
            serve_loop(comm, engine, loaded, root, caches)
    except BaseException:
        # The job ends on a failure (a rank lost): the queued clients learn so, whether
        # rank 0 gets here before the launcher's kill or the guardian answers after it.
        if comm.rank == 0:
            close_server(held, http_api.rank_lost())
        raise
    if comm.rank == 0:
        close_server(held, http_api.shutting_down())
        if run.as_json:  # what GET /health said last, as the last stdout line
            import json

            print(json.dumps({**state.health(), "ranks": comm.size}), flush=True)


def read_preloads(args: ServeConfig) -> list[dict]:
    """Rank 0, before the model loads: the meta.json of every --preload-cache."""
    from ..engine.cache.prompt_cache import read_meta
    from ..errors import UserError

    if len(args.preload) > args.cache_entries:
        raise UserError(f"{len(args.preload)} --preload-cache directories, more than "
                        f"--cache-entries {args.cache_entries}")
    return [read_meta(directory) for directory in args.preload]


def open_server(args: ServeConfig, sampling: SamplingConfig, held: dict):
    """Rank 0, before the model loads: bind the address (or refuse it) and start
    answering /health ("loading" until the model is in)."""
    from ..errors import UserError
    from ..server import http_api

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        spmd_log().warning("listening on %s without --api-key: anyone who reaches it may "
                           "use the model", args.host)
    state = http_api.ServerState(sampling, args.api_key)
    try:
        server = http_api.make_server(args.host, args.port, state)
    except OSError as error:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") \
            from None
    from ..server.guardian import GuardianLink

    state.guardian = GuardianLink()
    held.update(state=state, server=server, thread=http_api.start(server))


def close_server(held: dict, error):
    """Stop taking requests; those still queued get ``error`` (an ApiError: 503)."""
    if "server" not in held:
        return
    held["state"].drain(error)
    held["server"].shutdown()
    held["server"].server_close()
    held["state"].guardian.close()


def spmd_log():
    from ..runtime.spmd import log

    return log


def catch_signals(comm, state):
    """SIGTERM and SIGINT stop the server in order: rank 0 stops taking requests and
    broadcasts the end; the other ranks wait for it. The watchdog, which sees the
    signals through the wakeup fd, then lets the ranks exit by themselves. A signal sent
    to the whole process group reaches a rank twice (directly and forwarded by mpiexec):
    repeats within REPEAT_S count as one; a later one aborts at once."""
    import time

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: None)
    first = []

    def on_interrupt(number: int) -> bool:
        now = time.monotonic()
        if first:
            return now - first[0] < REPEAT_S
        first.append(now)
        if state is not None:
            spmd_log().info("signal %d: finishing the current request, then stopping", number)
            state.stopping.set()
        return True

    if comm.watchdog is not None:
        comm.watchdog.on_interrupt = on_interrupt


