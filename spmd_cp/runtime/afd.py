"""Attention-FFN disaggregation (``--afd A:F``): A attention ranks and F FFN ranks, and
the bipartite communicator their hidden states cross every layer.

World ranks 0 .. A-1 are attention ranks (rank 0 samples, as always), A .. N-1 FFN
ranks. The attention ranks are a context-parallel group of their own (``side``); each
rank's neighbours on the bipartite communicator are every rank of the other side
(``MPI_Dist_graph_create_adjacent``), and a layer's exchange is one
``MPI_Neighbor_alltoall`` of row counts followed by one ``Ineighbor_alltoallv`` out and
one back per micro-batch:

    attention rank:  counts ->   rows out (mb 0, 1, ..)  ->  wait rows back (mb 0, 1, ..)
    FFN rank:        counts <-   wait mb 0, compute, send it back; wait mb 1, ...

Every rank posts the out and back exchanges in the same order (MPI's rule for
non-blocking collectives), so an FFN rank computes micro-batch 0 while micro-batch 1
is still arriving and 0's result is already on its way back.

A decode step computes its token on every attention rank: only the first sends it
(``replicated``), and each FFN rank sends its result back to all of them.

Timing for the straggler summary: each rank adds up the time it waited for the other
side and the time it worked between exchanges; on each side the rank that waited least
is the one the others wait for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .comm import Comm, offsets


def afd_obstacle(spec: str | None, ranks: int) -> str | None:
    """Why ``--afd spec`` cannot split ``ranks`` ranks, or None."""
    if spec is None:
        return None
    try:
        attention, ffn = (int(part) for part in spec.split(":"))
    except ValueError:
        return f"--afd {spec}: expected A:F, attention and FFN ranks (e.g. 2:1)"
    if attention < 1 or ffn < 1:
        return f"--afd {spec}: each side needs at least one rank"
    if attention + ffn != ranks:
        return (f"--afd {spec} names {attention + ffn} ranks, the job has {ranks}: "
                "A + F must be the ranks launched")
    return None


@dataclass(frozen=True)
class AfdRoles:
    """How many ranks run attention and how many the feed-forward."""

    attention: int
    ffn: int

    @classmethod
    def of(cls, spec: str, ranks: int) -> AfdRoles:
        why = afd_obstacle(spec, ranks)
        if why:
            raise UserError(why)
        attention, ffn = (int(part) for part in spec.split(":"))
        return cls(attention, ffn)

    def is_attention(self, world_rank: int) -> bool:
        return world_rank < self.attention

    def peers(self, world_rank: int) -> list[int]:
        """The world ranks on the other side of ``world_rank``'s."""
        if self.is_attention(world_rank):
            return list(range(self.attention, self.attention + self.ffn))
        return list(range(self.attention))

    def as_dict(self) -> dict:
        return {"attention": self.attention, "ffn": self.ffn}


@dataclass
class CrossingTimes:
    """This rank's time waiting for the other side, and working between exchanges."""

    wait_s: float = 0.0
    work_s: float = 0.0
    exchanges: int = 0
    rows: int = 0  # token rows sent out (an attention rank's; a decode token once)
    row_layers: int = 0  # rows sent out, every layer's
    _since: float | None = field(default=None, repr=False)

    def waited(self, start: float, end: float):
        if self._since is not None:
            self.work_s += start - self._since
        self.wait_s += end - start
        self._since = end

    def begin(self):
        """A forward pass starts: work counts from now (not the command's own work
        between forwards, sampling or writing)."""
        self._since = time.perf_counter()

    def as_dict(self) -> dict:
        return {"wait_s": round(self.wait_s, 6), "work_s": round(self.work_s, 6),
                "exchanges": self.exchanges}


class Bipartite:
    """The exchanges of one rank with the other side (``comm``: the dist-graph Comm)."""

    def __init__(self, comm: Comm, roles: AfdRoles, world_rank: int, micro_batches: int):
        self.comm, self.roles, self.micro_batches = comm, roles, micro_batches
        self.peers = roles.peers(world_rank)
        self.attention = roles.is_attention(world_rank)
        self.times = CrossingTimes()

    @classmethod
    def open(cls, world: Comm, roles: AfdRoles, micro_batches: int) -> Bipartite:
        """Collective on ``world``: the bipartite communicator."""
        peers = roles.peers(world.rank)
        graph = world.mpi.Create_dist_graph_adjacent(peers, peers, reorder=False)
        comm = Comm(graph, world.watchdog)
        comm.tracer = world.tracer
        return cls(comm, roles, world.rank, micro_batches)

    def counts(self, headers: np.ndarray) -> np.ndarray:
        """Send ``headers[p]`` (an int64 row: afd_attention.HEADER's fields, then the rows
        of each micro-batch) to peer p; return every peer's."""
        send = np.ascontiguousarray(headers, np.int64)
        recv = np.empty((len(self.peers), send.shape[1]), np.int64)
        with self._waiting("AFD counts"):
            self.comm.mpi.Neighbor_alltoall(send, recv)
        self.comm.bytes_sent += send.nbytes
        return recv

    def post(self, sends: list[np.ndarray], recv_rows: list[int], width: int, dtype):
        """Start one micro-batch's exchange: ``sends[p]`` (rows, w) to peer p, and
        ``recv_rows[p]`` rows of ``width`` from it. Returns (request, receive buffers,
        what to keep alive)."""
        send = np.concatenate([s.reshape(-1) for s in sends]) if sends else np.zeros(0, dtype)
        send = np.ascontiguousarray(send, dtype)
        send_counts = [s.size for s in sends]
        recv_counts = [r * width for r in recv_rows]
        recv = np.empty(sum(recv_counts), dtype)
        request = self.comm.mpi.Ineighbor_alltoallv(
            [send, (send_counts, offsets(send_counts))],
            [recv, (recv_counts, offsets(recv_counts))])
        self.comm.bytes_sent += send.nbytes
        pieces = np.split(recv, np.cumsum(recv_counts)[:-1]) if recv_counts else []
        return request, [p.reshape(r, width) for p, r in zip(pieces, recv_rows)], send

    def wait(self, request, what: str):
        with self._waiting(what):
            request.Wait()

    def _waiting(self, what: str):
        return _Timed(self, what)


class _Timed:
    """A blocking wait: the watchdog bounds it, the trace shows it, the times count it."""

    def __init__(self, link: Bipartite, what: str):
        self.link, self.what = link, what

    def __enter__(self):
        self.start = time.perf_counter()
        self.inner = self.link.comm.waiting(self.what)
        self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        self.link.times.waited(self.start, time.perf_counter())
        return False


def straggler_summary(per_rank: list[dict], roles: AfdRoles) -> dict:
    """Per side, the rank the others waited for (the one that waited least, as a share
    of its exchange time) and that share; every rank's share beside it."""
    summary = {}
    sides = {"attention": range(roles.attention),
             "ffn": range(roles.attention, roles.attention + roles.ffn)}
    for side, ranks in sides.items():
        shares = {}
        for rank in ranks:
            t = per_rank[rank]
            busy = t["wait_s"] + t["work_s"]
            shares[rank] = round(t["wait_s"] / busy, 4) if busy > 0 else 0.0
        slowest = min(shares, key=shares.get)
        summary[side] = {"slowest_rank": slowest, "wait_share": shares[slowest],
                         "wait_shares": [shares[r] for r in ranks]}
    return summary
