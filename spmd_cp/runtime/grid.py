"""The ranks as a grid of context-parallel groups of tensor-parallel ranks (``--tp T``).

N ranks form N / T tensor-parallel (TP) groups of T consecutive ranks: a hostfile fills
a host's slots with consecutive ranks, so a TP group sits on one host by default, where
its two Allreduces a layer are cheapest. World rank ``r`` is TP rank ``r % T`` of group
``r // T``, and CP rank ``r // T`` among the ranks of the same TP index: the ring, pass-Q's
Alltoall and the all-gathers of attention run among those N / T ranks, each holding the
same KV heads of a different part of the sequence.

    world rank:   0  1 | 2  3        (N = 4, T = 2)
    TP group:     0  0 | 1  1        Allreduce of o and down, the vocabulary's pieces
    CP rank:      0  0 | 1  1        ring among {0, 2} and among {1, 3}

The sub-communicators are split once, here; everything below takes the one it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .afd import AfdRoles, Bipartite
from .comm import Comm


def grid_obstacle(tp: int, ranks: int) -> str | None:
    """Why ``--tp tp`` cannot form groups of ``ranks`` ranks, or None."""
    if tp < 1:
        return f"--tp {tp}: a tensor-parallel group needs at least one rank"
    if ranks % tp:
        return f"--tp {tp} does not divide the {ranks} ranks into tensor-parallel groups"
    return None


@dataclass(frozen=True)
class Grid:
    """This rank's place in the CP x TP grid and the communicators of its groups."""

    world: Comm
    cp: Comm  # the ranks of this TP index, one per group: attention's communicator
    tp: Comm | None  # this rank's TP group (None: T = 1, nothing split)
    # --afd: the link to the other side; ``cp`` is then this rank's side (the attention
    # ranks, or the FFN ranks, which run no attention)
    afd: Bipartite | None = None

    @classmethod
    def of(cls, world: Comm, tp: int = 1) -> Grid:
        """Collective on ``world``: the grid of ``--tp tp`` (UserError where it does not
        divide the ranks)."""
        why = grid_obstacle(tp, world.size)
        if why:
            raise UserError(why)
        if tp == 1:
            return cls(world, world, None)
        group, index = divmod(world.rank, tp)
        tp_comm = _sub(world, world.mpi.Split(group, index))
        cp_comm = _sub(world, world.mpi.Split(index, group))
        return cls(world, cp_comm, tp_comm)

    @classmethod
    def of_afd(cls, world: Comm, roles: AfdRoles, micro_batches: int) -> Grid:
        """Collective on ``world``: the sides of ``--afd`` and the link between them."""
        side = _sub(world, world.mpi.Split(0 if roles.is_attention(world.rank) else 1,
                                           world.rank))
        return cls(world, side, None, Bipartite.open(world, roles, micro_batches))

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    def world_rank(self, cp_rank: int, tp_rank: int = 0) -> int:
        """The world rank at ``cp_rank`` of the CP groups, TP rank ``tp_rank``."""
        return cp_rank * self.tp_size + tp_rank

    @property
    def comms(self) -> list[Comm]:
        """Every communicator this rank sends through, each once."""
        sides = [self.cp, self.afd.comm] if self.afd is not None else []
        return [self.world] + ([self.cp, self.tp] if self.tp is not None else sides)

    @property
    def bytes_sent(self) -> int:
        """Payload this rank sent to others over all its communicators."""
        return sum(c.bytes_sent for c in self.comms)

    def describe(self) -> str:
        if self.afd is not None:
            roles = self.afd.roles
            return (f"{roles.attention} attention rank(s) (context parallel) and {roles.ffn} "
                    "FFN rank(s)")
        cp = self.world.size // self.tp_size
        return f"{cp} context-parallel group(s) x {self.tp_size} tensor-parallel rank(s)"

    def as_dict(self) -> dict:
        if self.afd is not None:
            return {"tp": 1, "cp": self.afd.roles.attention}
        return {"tp": self.tp_size, "cp": self.world.size // self.tp_size}


def _sub(world: Comm, mpi_comm) -> Comm:
    """A Comm over ``mpi_comm``, bounded by ``world``'s watchdog and traced with it."""
    comm = Comm(mpi_comm, world.watchdog)
    comm.tracer = world.tracer
    return comm
