"""The engine of one rank under ``--afd A:F``: an attention rank's ``Engine`` over the
attention ranks (its MLPs across the link, afd_attention.py), or an FFN rank's
``FfnEngine`` (afd_ffn.py). Decisions made here, once:

- decode steps are MLX's graph step in the replicated layout, its merges through
  mpi4py over the attention ranks (``--decode-comm mpi``): the native step computes
  the MLP in place, the split layout would cut an MLP the attention ranks do not hold,
  and MLX's own MPI group spans every rank, FFN ranks included;
- the KV dtype follows ``--kv-dtype`` (auto is float32 here: decode_plan.choose_kv_dtype).
"""

from __future__ import annotations

import dataclasses
import logging

from ...config import DecodeConfig, RunConfig
from ...runtime.afd import AfdRoles
from ...runtime.comm import Comm
from ...runtime.device import Compute
from ...runtime.grid import Grid
from .afd_attention import remote_feed_forward
from .afd_ffn import FfnEngine, FfnModel, FfnServer
from ..engine import Engine
from ..model import CPModel

log = logging.getLogger("spmd_cp")


def afd_decode(decode: DecodeConfig) -> DecodeConfig:
    """``decode`` as ``--afd`` runs it (the module's docstring says why)."""
    return dataclasses.replace(decode, decode_tp="off", decode_comm="mpi")


def open_afd_engine(world: Comm, loaded, run: RunConfig, decode: DecodeConfig,
                    compute: Compute, on_layer=None):
    """Collective on ``world``: this rank's engine under ``--afd`` (its sides split and
    the bipartite communicator opened here)."""
    roles = AfdRoles.of(run.afd, world.size)
    grid = Grid.of_afd(world, roles, run.afd_micro_batches)
    decode = afd_decode(decode)
    if world.rank == 0:
        log.info("--afd %s: %s; %d micro-batch(es) a layer", run.afd, grid.describe(),
                 run.afd_micro_batches)
    if roles.is_attention(world.rank):
        model = remote_feed_forward(CPModel(loaded.model, None, run.kv_dtype, compute),
                                    grid.afd, grid.cp.rank, roles.ffn)
        return Engine(model, world, algo=run.cp_algo, prefill_chunk=run.prefill_chunk,
                      on_layer=on_layer, decode=decode, grid=grid)
    server = FfnServer(loaded.ffn_layers, grid.afd, world.tracer)
    layers = loaded.model.model.layers
    return FfnEngine(FfnModel(compute, len(layers), layers), server, world, grid,
                     run.prefill_chunk, run.cp_algo, decode)
