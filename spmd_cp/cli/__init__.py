"""spmd-cp: exact context-parallel long-context inference for MLX models under MPI.

Every rank runs this same entry point:

    mpiexec -n 2 spmd-cp generate --prompt-file long.txt --max-tokens 200
    mpiexec -n 4 spmd-cp score --text-file doc.txt --output tokens.jsonl --json
    mpiexec -n 2 spmd-cp serve --port 8080

Rank 0 reads and tokenizes the prompt, samples, and alone writes to stdout; every rank
holds the whole model (or, with --shard-weights, layers i mod N and 1/N of the
vocabulary) and 1/N of the KV cache. One module per command (generate, score,
batch, serve, doctor); the steps they share are in steps.py. Importing this package must not
initialise MPI: main() may still re-execute the process with a faster BLAS.
"""

from __future__ import annotations

import sys

import click

from .. import blas
from ..runtime.scheduling import use_batch_scheduling
from .batch import batch
from .doctor import doctor
from .generate import generate
from .options import RangeError
from .score import score
from .serve import serve


def main():
    # On every thread there is now; inherited by later ones and across the re-exec.
    use_batch_scheduling()
    # Before MPI_Init: possibly re-exec with an optimized BLAS.
    blas.ensure_fast_blas()
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as error:
        # Argument errors are found identically on every rank before MPI starts
        # talking, so each rank exits on its own; print once.
        if _launcher_rank() == 0:
            if isinstance(error, RangeError) or type(error) is click.ClickException:
                print(f"spmd-cp: error: {error.message}", file=sys.stderr, flush=True)
            else:
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


@cli.command("trace-summary")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
def trace_summary(trace_file):
    """Each rank's compute and wait shares in a --trace file, and the slowest rank."""
    from ..runtime.trace import summarize

    try:
        summary = summarize(trace_file)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        # ValueError covers bad JSON and bad UTF-8 (a binary or truncated file).
        what = error.strerror if isinstance(error, OSError) else type(error).__name__
        raise click.ClickException(
            f"{trace_file} is not a readable spmd-cp trace ({what}); write one with "
            f"--trace FILE") from None
    click.echo(summary)


for command in (generate, score, batch, serve, doctor):
    cli.add_command(command)

if __name__ == "__main__":
    main()
