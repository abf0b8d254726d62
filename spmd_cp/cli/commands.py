"""The `spmd-cp` click group: one command per module, and `trace-summary`."""

from __future__ import annotations

import click

from .batch import batch
from .doctor import doctor
from .generate import generate
from .score import score
from .serve import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Exact context-parallel long-context LLM inference for MLX models, under MPI."""


@cli.command("trace-summary")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
def trace_summary(trace_file):
    """Each rank's compute and wait shares in a --trace file, and the slowest rank."""
    from ..runtime.trace import summarize

    try:
        summary = summarize(trace_file)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        from ..runtime.spmd import EXIT_USER_ERROR

        # ValueError covers bad JSON and bad UTF-8 (a binary or truncated file).
        what = error.strerror if isinstance(error, OSError) else type(error).__name__
        refused = click.ClickException(
            f"{trace_file} is not a readable spmd-cp trace ({what}); write one with "
            f"--trace FILE")
        refused.exit_code = EXIT_USER_ERROR  # bad input, as for every other command
        raise refused from None
    click.echo(summary)


for command in (generate, score, batch, serve, doctor):
    cli.add_command(command)
