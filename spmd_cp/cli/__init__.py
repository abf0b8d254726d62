"""spmd-cp: exact context-parallel long-context inference for MLX models under MPI.

Every rank runs this same entry point:

    mpiexec -n 2 spmd-cp generate --prompt-file long.txt --max-tokens 200
    mpiexec -n 4 spmd-cp score --text-file doc.txt --output tokens.jsonl --json
    mpiexec -n 2 spmd-cp serve --port 8080

Rank 0 reads and tokenizes the prompt, samples, and alone writes to stdout; every rank
holds the whole model (or, with --shard-weights, layers i mod N and 1/N of the
vocabulary) and 1/N of the KV cache. One module per command (generate, score,
batch, serve, doctor), gathered into one click group in commands.py; the steps they share
are in steps.py, the run they build in run/builder.py. Importing this package loads
neither MLX nor MPI: main() may still re-execute the process with a faster BLAS, so it
imports the commands only after that.
"""

from __future__ import annotations

import sys

import click

from .. import blas
from ..runtime.scheduling import use_batch_scheduling


def main():
    # On every thread there is now; inherited by later ones and across the re-exec.
    use_batch_scheduling()
    # Before MPI_Init: possibly re-exec with an optimized BLAS.
    blas.ensure_fast_blas()
    # The commands import MLX and mlx-lm (transformers: about 2 s), so only now, in the
    # process that stays.
    from .commands import cli
    from .options import RangeError

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


if __name__ == "__main__":
    main()
