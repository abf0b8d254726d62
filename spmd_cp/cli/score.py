"""`spmd-cp score`: the log-probability of every token of a document, one prefill.

    mpiexec -n 4 spmd-cp score --text-file doc.txt --output tokens.jsonl --json
"""

from __future__ import annotations

import sys

import click

from ..config import RunConfig, ScoreConfig, from_options
from .options import common_options


@click.command()
@common_options
@click.option("--text-file", type=click.Path(dir_okay=False), required=True, help="The document to score.")
@click.option("--output", type=click.Path(dir_okay=False), required=True,
              help="JSONL file: one line per predicted position (pos, token, logprob, argmax); "
                   "replaced at once when complete.")
def score(**options):
    """Log-probability of every token of a document given everything before it."""
    from .steps import run_spmd

    sys.exit(run_spmd(score_command, *from_options(options, RunConfig, ScoreConfig)))


def score_command(comm, run: RunConfig, args: ScoreConfig):
    import time

    import mlx.core as mx

    from ..engine.cache.cache import NO_REWIND
    from ..engine.startup import startup_fields, warm_up
    from ..run.builder import RunBuilder
    from ..runtime import spmd
    from . import steps

    text = spmd.on_root(comm, validate, run, args)
    # A quantized file's matrices held packed, as generate holds them: the prefill reads
    # them a tile at a time (no decode step follows, but the memory is the same).
    builder = RunBuilder(comm, run)  # no decode steps follow
    loaded = builder.load()
    run = builder.run  # settled
    ids, forecast = spmd.on_root(comm, tokenize_document, comm, loaded, run, text)
    engine = builder.engine()
    cache = engine.new_cache()
    cache.rewinds_to = NO_REWIND  # scored once, never continued
    warmup_s = warm_up(engine, decode=False)  # no decode step follows
    mx.reset_peak_memory()
    start = time.perf_counter()
    _, records = engine.prefill(cache, ids, score=True)
    elapsed = time.perf_counter() - start
    metrics = steps.rank_metrics(comm, cache, steps.model_bytes(engine, loaded), engine.grid)
    if comm.rank == 0:
        write_records(args.output, records)
        report(comm, run, engine, records, len(ids), elapsed,
               {**startup_fields(engine, warmup_s), "memory_forecast": forecast, **metrics})


def validate(run: RunConfig, args: ScoreConfig) -> str:
    """Rank 0, before anything heavy: the output may be written and destroys no input."""
    from .outputs import Output, check_outputs, claim_outputs
    from .steps import model_inputs, read_text_file, trace_output

    outputs = [Output("--output", args.output), trace_output(run)]
    claim_outputs(outputs)  # another run writing the same places is refused at once
    check_outputs(outputs,
                  {"the text file": [args.text_file], **model_inputs(run)}, run.overwrite)
    return read_text_file(args.text_file, "text file", run)


def tokenize_document(comm, loaded, run: RunConfig, text: str):
    """Rank 0: the document's ids, with the model's BOS token in front if it wants one,
    and the memory forecast that let them run."""
    import numpy as np

    from .steps import check_memory, tokenize_checked

    ids = tokenize_checked(loaded, text, run.max_context, parse_special=run.parse_special)
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    if getattr(loaded.tokenizer, "add_bos_token", False) and bos is not None and ids[0] != bos:
        ids = np.concatenate([[bos], ids])
    if len(ids) < 2:
        from ..errors import UserError

        raise UserError(f"the text file has {len(ids)} token: scoring needs at least 2 "
                        f"(each token is scored given the ones before it)")
    return ids, check_memory(comm, loaded, run, len(ids), len(ids), score=True, window_tail=0)


def write_records(path: str, records):
    """Rank 0: one JSON line per predicted position, replacing ``path`` atomically."""
    import json

    from ..runtime.files import write_text_atomically

    write_text_atomically(path, (
        json.dumps({"pos": pos, "token": token, "logprob": logprob, "argmax": argmax}) + "\n"
        for pos, token, logprob, argmax in zip(records.pos, records.token, records.logprob,
                                               records.argmax)))


def report(comm, run: RunConfig, engine, records, tokens: int, elapsed: float, metrics: dict):
    import json
    import math

    import numpy as np

    from .steps import algos_used, log, write_stdout

    mean_nll = -float(np.mean(records.logprob)) if records.logprob else 0.0
    summary = {
        "ppl": math.exp(mean_nll),
        "tokens": int(tokens),
        "predicted": len(records.pos),
        "ranks": comm.size,
        **engine.grid.as_dict(),
        "algo": algos_used(engine),
        "prefill_s": round(elapsed, 6),
        "prefill_tok_s": round(tokens / max(elapsed, 1e-9), 3),
        **metrics,
    }
    log.info("scored %d tokens: ppl %.3f, %.1f tok/s", tokens, summary["ppl"],
             summary["prefill_tok_s"])
    if run.as_json:
        write_stdout(json.dumps(summary) + "\n")
