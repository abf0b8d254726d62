"""``--tp T``'s and ``--afd A:F``'s checks before anything loads.

Tensor-parallel groups (runtime/grid.py, engine/weights/tensor_groups.py) cut every matrix into
slices MLX computes with, so what relies on whole matrices on every rank does not combine
with them, and is refused here in one line rather than after a long load:

- ``--shard-weights on``: both divide the weights (by layers, by slices); with ``--tp``
  the slices already hold 1/T of every layer, and ``auto`` does not shard.
- the native decode step (``--decode-step native``) and the split decode layout
  (``--decode-tp on``): a grid decodes in MLX's step over its own slices (the decode plan
  says why, decode_plan.py).

``--afd`` (engine/afd/afd_attention.py) moves every MLP off the attention ranks: the same
three, and ``--tp`` with it, are refused, each with its reason.
"""

from __future__ import annotations

from ..config import DecodeConfig, RunConfig
from ..errors import UserError
from ..runtime.afd import afd_obstacle
from ..runtime.grid import grid_obstacle


def check_grid(run: RunConfig, ranks: int, decode: DecodeConfig | None = None):
    """UserError where ``--tp`` does not divide the ranks or names a setting it cannot
    run with (``decode``: the decode flags, where decode steps follow)."""
    why = grid_obstacle(run.tp, ranks) or afd_obstacle(run.afd, ranks)
    if why:
        raise UserError(why)
    decoding = decode is not None
    if run.afd is not None:
        check_afd(run, decode)
    if run.tp == 1:
        return
    refused = [("--shard-weights on", run.shard_weights == "on",
                "both divide the weights: the slices hold 1/T of every layer already"),
               ("--decode-step native", decoding and decode.decode_step == "native",
                "the native step reads whole matrices; a grid decodes in MLX's step"),
               ("--decode-tp on", decoding and decode.decode_tp == "on",
                "the split step would cut the slices again")]
    for flag, given, reason in refused:
        if given:
            raise UserError(f"--tp {run.tp} does not combine with {flag} ({reason})")


def check_afd(run: RunConfig, decode: DecodeConfig | None):
    """UserError where ``--afd`` meets a setting it does not run with, naming why."""
    decoding = decode is not None
    refused = [("--tp", run.tp > 1, "the FFN ranks divide the feed-forward already, and "
                "attention ranks hold whole attention weights"),
               ("--shard-weights on", run.shard_weights == "on",
                "each side holds its part of every layer already"),
               ("--decode-step native", decoding and decode.decode_step == "native",
                "the native step computes the MLP in place; --afd decodes in MLX's step"),
               ("--decode-tp on", decoding and decode.decode_tp == "on",
                "the attention ranks hold no MLP to split"),
               ("--decode-comm mlx", decoding and decode.decode_comm == "mlx",
                "MLX's MPI group spans the FFN ranks too; the attention ranks merge "
                "through mpi4py")]
    for flag, given, reason in refused:
        if given:
            raise UserError(f"--afd {run.afd} does not combine with {flag} ({reason})")


def keep_quantized_hint(run: RunConfig, path: str) -> str | None:
    """Rank 0, before the load: where ``--tp`` will hold 1/T of a quantized file's
    float32 form (the CPU default), or ``--afd``'s sides all of it between them, what
    ``--keep-quantized`` would hold instead (from the file's headers); None where it would
    not hold less."""
    from .sharding import layout_of

    if (run.tp == 1 and run.afd is None) or run.keep_quantized:
        return None
    try:
        dense = layout_of(path, False, False).replicated
        packed = layout_of(path, True, False).replicated
    except (UserError, ValueError, KeyError):  # a hint only: the load says what is wrong
        return None
    if packed >= dense:
        return None
    if run.afd is not None:
        return (f"--afd {run.afd}: the two sides hold the float32 weights between them "
                f"({dense / 2**30:.2f} GB in all); --keep-quantized would hold "
                f"{packed / 2**30:.2f} GB (MLX's quantized products: slower on a CPU)")
    return (f"--tp {run.tp}: each rank holds 1/{run.tp} of the float32 weights "
            f"({dense / 2**30:.2f} GB in all); --keep-quantized would hold 1/{run.tp} of "
            f"{packed / 2**30:.2f} GB (MLX's quantized products: slower on a CPU)")

