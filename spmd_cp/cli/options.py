"""Flags shared by every command that runs the model (DESIGN.md section 6 names)."""

from __future__ import annotations

import click


def common_options(fn):
    """Flags shared by every command that runs the model (DESIGN.md section 6)."""
    from ..attention import PREFILL_ALGOS

    options = [
        click.option("--model", "model_path", default=None, metavar="PATH",
                     help="GGUF file or MLX/HF model directory (default: embedded SmolLM2-135M-Instruct)."),
        click.option("--cp-algo", type=click.Choice(PREFILL_ALGOS), default="auto", show_default=True,
                     help="Context-parallel prefill attention."),
        click.option("--prefill-chunk", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Prefill the prompt in chunks of this many tokens (0: one chunk)."),
        click.option("--max-context", type=click.IntRange(min=1), default=None,
                     help="Refuse prompts longer than this (default: the model's limit)."),
        click.option("--keep-quantized", is_flag=True,
                     help="Keep quantized weights (default on CPU: dequantize to float32, much faster)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line."),
        click.option("--memory-limit", default=None, metavar="SIZE",
                     help="Refuse jobs whose forecast exceeds this per rank, e.g. 2GB "
                          "(default: this host's memory / its ranks)."),
        click.option("--comm-timeout", type=click.FloatRange(min=0), default=None,
                     help="Abort the job when a rank waits this many seconds for a peer during "
                          "prefill/decode (default 45; 0 disables)."),
        click.option("--trace", default=None, metavar="FILE",
                     help="Write a Chrome trace (Perfetto) of every rank's layers, waits and "
                          "transfers; see spmd-cp trace-summary."),
        click.option("-v", "--verbose", is_flag=True, help="Log from every rank, not only rank 0."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def decode_options(fn):
    """Flags of the decode loop (generate, batch)."""
    options = [
        click.option("--kv-interleave", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Generated tokens' K/V go to the least loaded rank in runs of this many."),
        click.option("--decode-merge", type=click.Choice(["allgather", "allreduce"]),
                     default="allgather", show_default=True,
                     help="How decode merges the ranks' partial attention each layer."),
        click.option("--decode-tp", type=click.Choice(["auto", "on", "off"]), default="auto",
                     show_default=True,
                     help="Split decode's projections, MLP and LM head across ranks too "
                          "(auto: time both in the first steps and keep the faster)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn
