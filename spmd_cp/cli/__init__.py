"""spmd-cp: exact context-parallel long-context inference for MLX models under MPI.

Every rank runs this same entry point:

    mpiexec -n 2 spmd-cp generate --prompt-file long.txt --max-tokens 200
    mpiexec -n 4 spmd-cp score --text-file doc.txt --output tokens.jsonl --json

Rank 0 reads and tokenizes the prompt, samples, and alone writes to stdout; every rank
holds the whole model and 1/N of the KV cache.
"""

from __future__ import annotations

import sys

import click

from .. import blas
from .batch import batch
from .doctor import doctor
from .options import common_options, decode_options


def main():
    # Before MPI_Init and before MLX loads: possibly re-exec with an optimized BLAS.
    blas.ensure_fast_blas()
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as error:
        # Argument errors are found identically on every rank before MPI starts
        # talking, so each rank exits on its own; print once.
        if _launcher_rank() == 0:
            error.show()
        sys.exit(error.exit_code)


def _launcher_rank() -> int:
    import os

    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Exact context-parallel long-context LLM inference for MLX models, under MPI."""


@cli.command()
@common_options
@click.option("--prompt", default=None, help="Prompt text, or - to read standard input.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None, help="Read the prompt from a file.")
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as is.")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temp", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@click.option("--save-cache", default=None, metavar="DIR",
              help="After answering, save every rank's KV shard and the conversation here.")
@click.option("--load-cache", default=None, metavar="DIR",
              help="Continue a conversation saved with --save-cache (same model and rank "
                   "count): only the new tokens are prefilled.")
@decode_options
def generate(**options):
    """Generate a continuation of a (long) prompt."""
    from .commands import run_command

    sys.exit(run_command("generate", options))


@cli.command()
@common_options
@click.option("--text-file", type=click.Path(dir_okay=False), required=True, help="The document to score.")
@click.option("--output", type=click.Path(dir_okay=False), required=True,
              help="JSONL file: one line per predicted position (pos, token, logprob, argmax).")
def score(**options):
    """Log-probability of every token of a document given everything before it."""
    from .commands import run_command

    sys.exit(run_command("score", options))


@cli.command("trace-summary")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
def trace_summary(trace_file):
    """Each rank's compute and wait shares in a --trace file, and the slowest rank."""
    from ..runtime.trace import summarize

    click.echo(summarize(trace_file))


cli.add_command(doctor)
cli.add_command(batch)

if __name__ == "__main__":
    main()
