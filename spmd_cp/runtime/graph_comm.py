"""Collectives inside MLX's graph, for decode steps: no host round trip per message.

A tensor-parallel decode step issues 4 small collectives per layer (121 for a 30-layer
model). Through mpi4py each one evaluates the graph so far, copies the result to the
host, runs MPI and wraps the answer in a new array: the Python thread and MLX's compute
thread hand over about 10 times per layer, and on the 2-core machine those hand-overs
cost more than the collectives (a split step at N = 2: 94 ms, of which its compute is
45 ms). MLX's own distributed ops (``mx.distributed.all_gather``/``all_sum``/``all_max``)
are graph nodes that its compute thread runs in order: Python builds the whole step,
evaluates once, and the step costs its compute plus the messages (measured: 61 ms).

Two MLX backends carry them, opened once per process from the MPI communicator:

- MLX's ``mpi`` backend over the job's own MPICH, through the ABI adapter of
  runtime/mpi_abi.py (MLX speaks Open MPI's ABI only): each collective is one MPI call
  on MLX's compute thread, over MPICH's shared memory between ranks on a host (576
  floats at N = 2: 8 against 32-47 us through the ring). Taken where every rank can
  build and bind it;
- else MLX's ``ring`` backend (TCP sockets, one per neighbour, the backend mlx.launch
  uses over Thunderbolt): every rank opens a port and the addresses are exchanged with
  MPI.

``--graph-backend mpi|ring`` forces one (``auto``, the default, tries them in
that order). Prefill keeps mpi4py (large messages, overlapped on a thread).

Every rank must evaluate every collective, in the same order: the decode step's
collectives form one chain (each depends on the previous one through the residual), so
MLX's evaluation order is the same on every rank.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass

import mlx.core as mx

from . import mpi_abi
from .device import Compute
from .spmd import first_reason

log = logging.getLogger("spmd_cp")

# Sums whose gathered rows take at most this many bytes go through all_gather (allreduce).
GATHER_SUM_MAX_BYTES = 1 << 20

_group_cache: dict = {}  # (backend, rank, size) -> mx.distributed.Group, one per process


@dataclass(frozen=True)
class RingAddresses:
    """Where every rank's ring backend listens: one "host:port" per rank."""

    hosts: list

    def hostfile_json(self) -> str:
        return json.dumps([[address] for address in self.hosts])


class GraphCollectives:
    """The data-plane collectives of ``Comm`` as lazy MLX graph nodes over ``group``.

    Same names and shapes as Comm's, so the decode step's code takes either. Bytes are
    counted on ``comm`` with Comm's formulas. Nothing here evaluates.
    """

    def __init__(self, group, comm, backend: str):
        """``backend``: "mpi" or "ring", the MLX backend ``group`` belongs to."""
        self.group, self.comm, self.backend = group, comm, backend
        self.rank, self.size = comm.rank, comm.size
        self._latency = None

    def _count(self, nbytes: int):
        self.comm.bytes_sent += nbytes

    def split(self, comm, color: int, key: int) -> GraphCollectives | None:
        """Collective over this group: the graph collectives of ``comm``, a sub-group of
        these ranks split as ``MPI_Comm_split(color, key)`` made it (runtime/grid.py's
        CP and TP groups); None on the ring backend, which cannot split."""
        if self.backend != "mpi":
            return None
        return GraphCollectives(self.group.split(color, key), comm, self.backend)

    def allgather_rows(self, array: mx.array, axis: int, counts: list) -> mx.array:
        """Every rank's ``array`` concatenated along ``axis`` (``counts[r]`` rows from rank r;
        MLX's all_gather needs equal shapes, so shorter pieces travel padded)."""
        self._count((self.size - 1) * array.nbytes)
        widest = max(counts)
        if array.ndim == 2 and array.shape[0] == 1 and axis in (1, -1) and \
                min(counts) == widest:  # a decode row: (N, w) is (1, N * w) in memory
            return mx.distributed.all_gather(array, group=self.group).reshape(1, -1)
        moved = mx.moveaxis(array, axis, 0)
        if moved.shape[0] < widest:
            pad = mx.zeros((widest - moved.shape[0],) + moved.shape[1:], moved.dtype)
            moved = mx.concatenate([moved, pad])
        gathered = mx.distributed.all_gather(moved, group=self.group)  # (N * widest, ...)
        if min(counts) < widest:
            gathered = mx.concatenate([gathered[r * widest:r * widest + c]
                                       for r, c in enumerate(counts)])
        return mx.moveaxis(gathered, 0, axis)

    def gather_rows(self, array: mx.array, counts: list, root: int = 0) -> mx.array:
        """Every rank's 1-D ``array`` concatenated. Unlike Comm.gather_rows every rank gets
        the result and must evaluate it (a graph collective runs only where evaluated)."""
        return self.allgather_rows(array, 0, counts)

    def allgather_stack(self, array: mx.array) -> mx.array:
        self._count((self.size - 1) * array.nbytes)
        return mx.distributed.all_gather(array[None], group=self.group)

    def latency(self) -> float:
        """Seconds per collective as a decode step chains them (``chained_latency``),
        measured on first use and kept: every rank asks at the same point."""
        if self._latency is None:
            self._latency = chained_latency(self, self.comm)
        return self._latency

    def allreduce(self, array: mx.array, op: str) -> mx.array:
        """Every rank's ``array`` reduced by ``op`` ("sum" or "max"). A small sum is an
        all_gather summed in rank order on every rank: one message exchange instead of
        the ring's reduce-scatter and all-gather, 39 vs 55-107 us for 576 floats at
        N = 2 and still faster at 32K floats (69 vs 116 us; 2x at N = 4). Every rank
        sums the same gathered rows in the same order, so all hold the same bits."""
        if op == "sum" and self.size * array.nbytes <= GATHER_SUM_MAX_BYTES:
            self._count((self.size - 1) * array.nbytes)
            leading_one = array.ndim > 0 and array.shape[0] == 1  # (1, 1, D) in decode
            gathered = mx.distributed.all_gather(array if leading_one else array[None],
                                                 group=self.group)  # rows in rank order
            return gathered.sum(axis=0, keepdims=leading_one)
        self._count(2 * (self.size - 1) * array.nbytes // self.size)
        reduce = {"sum": mx.distributed.all_sum, "max": mx.distributed.all_max}[op]
        return reduce(array, group=self.group)

    def allreduce_onto(self, base: mx.array, array: mx.array) -> mx.array:
        """``base`` plus the sum of every rank's ``array``. A decode row (1, D) is gathered
        as (N, D) and summed onto ``base`` by one matmul, ``base + ones(1, N) @ rows``
        (``mx.addmm``): the gathered sum and the residual's add in one graph node
        instead of two (60 nodes fewer a split step of a 30-layer model). Every rank
        runs the same BLAS call on the same rows, so all hold the same bits."""
        if (array.ndim == 2 and array.shape[0] == 1 and base.shape == array.shape
                and base.dtype == array.dtype == mx.float32
                and self.size * array.nbytes <= GATHER_SUM_MAX_BYTES):
            self._count((self.size - 1) * array.nbytes)
            gathered = mx.distributed.all_gather(array, group=self.group)  # (N, D)
            return mx.addmm(base, _ones_row(self.size), gathered)
        return base + self.allreduce(array, "sum")


@functools.lru_cache(maxsize=None)
def _ones_row(size: int) -> mx.array:
    """(1, size) float32 ones, kept: the weights of a gathered sum's matmul."""
    ones = mx.ones((1, size), mx.float32)
    mx.eval(ones)
    return ones


def chained_latency(collectives, comm, width: int = 1024, repeats: int = 16,
                    rounds: int = 7) -> float:
    """Collective: seconds per collective as a decode step chains them, through
    ``collectives`` (GraphCollectives, or a Comm, whose every collective evaluates the
    graph before it and copies through the host): ``rounds`` evaluations of ``repeats``
    dependent sums of ``width`` floats, after one untimed round; the median round on
    each rank, the slowest rank's median. Its bytes are counted in ``comm.bytes_sent``
    like any others (they cross the links: 1.5 MB a rank at N = 4). One round alone
    varied 61-1,332 us per collective over the ring on the 2-core machine (first uses of
    the sockets, the peer's scheduling); the median of seven measured 51-60 us in 24
    calls."""

    def timed_round() -> float:
        chain = mx.ones((1, width), mx.float32)
        start = time.perf_counter()
        for _ in range(repeats):
            chain = collectives.allreduce(chain * 0.5, "sum")
        mx.eval(chain)
        return (time.perf_counter() - start) / repeats

    timed_round()  # the connections' first use
    seconds = statistics.median(timed_round() for _ in range(rounds))
    return max(comm.allgather_object(seconds))


def graph_obstacle(comm, compute: Compute) -> str | None:
    """Why this rank cannot run graph collectives, or None (local facts only)."""
    if comm.size == 1:
        return "one rank"
    if compute.gpu:
        return "the GPU path keeps MPI (MLX's backends move host memory here)"
    return None


def _own_address(processor: str, same_host: bool) -> str | None:
    """The address peers reach this rank's ring port at: loopback when every rank runs on
    this host, else what this host's name resolves to (None when that is loopback)."""
    if same_host:
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(processor)
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def open_graph_collectives(comm, mode: str = "auto", backend: str = "auto",
                           compute: Compute | None = None) -> tuple[GraphCollectives | None, str]:
    """Collective (every rank calls it): graph collectives over ``comm``'s ranks, or None
    and why not. ``mode`` "mpi" never opens them; "mlx" and "auto" open them where every
    rank can (all or none: a collective needs every rank), over MLX's MPI backend where
    every rank can take it, else over its ring backend. ``backend`` (--graph-backend):
    "mpi" forces the adapter (none where it cannot open), "ring" skips it. ``compute``:
    the run's (None: the default's); the GPU path keeps MPI."""
    if mode == "mpi":
        return None, "--decode-comm mpi"
    obstacle = first_reason(comm, graph_obstacle(comm, compute or Compute.resolve()))
    if obstacle:
        return None, obstacle
    why_not_mpi = "--graph-backend ring"
    if backend != "ring":
        group, why_not_mpi = _open_mpi(comm)
        if group is not None:
            return (GraphCollectives(group, comm, "mpi"),
                    "MLX's MPI backend over MPICH (ABI adapter)")
        if backend == "mpi":
            return None, f"--graph-backend mpi: {why_not_mpi}"
    group, why_not_ring = _open_ring(comm)
    if group is None:
        return None, why_not_ring
    return GraphCollectives(group, comm, "ring"), f"{why_not_ring}; not MPI: {why_not_mpi}"


def _open_mpi(comm):
    """Collective: (MLX's MPI group, None), or (None, the first rank's reason)."""
    refused = first_reason(comm, mpi_abi.local_obstacle())
    if refused:
        return None, refused
    library, failure = None, None
    try:
        library = mpi_abi.adapter_library()
    except RuntimeError as error:
        failure = str(error)
    failure = first_reason(comm, failure)  # all ranks built it, or none goes on
    if failure:
        return None, failure
    group, failure = _cached_group("mpi", comm, lambda: _init_mpi(comm, library))
    failure = first_reason(comm, failure)
    return (None, failure) if failure else (group, None)


def _open_ring(comm):
    """Collective: (MLX's ring group, a description), or (None, the first rank's reason)."""
    from mpi4py import MPI

    obstacle = None if mx.distributed.is_available(backend="ring") else \
        "this MLX has no ring backend"
    processor = MPI.Get_processor_name()
    hosts = comm.allgather_object(processor)
    address = None
    if obstacle is None:
        address = _own_address(processor, len(set(hosts)) == 1)
        if address is None:
            obstacle = f"host {processor} resolves to no address other ranks can reach"
    port = _free_port(address) if address is not None else 0
    answers = comm.allgather_object((obstacle, f"{address}:{port}"))
    reasons = [f"rank {r}: {why}" for r, (why, _) in enumerate(answers) if why]
    if reasons:
        return None, reasons[0]
    ring = RingAddresses([where for _, where in answers])
    # An init may fail on one rank (e.g. a port another process took meanwhile)
    group, failure = _cached_group("ring", comm, lambda: _init_ring(comm.rank, ring))
    failure = first_reason(comm, failure)  # all or none
    if failure:
        return None, failure
    return group, f"MLX ring backend over {ring.hosts[0].split(':')[0]}"


def _cached_group(backend: str, comm, init):
    """(MLX's ``backend`` group for ``comm``'s rank and size, None), opened by ``init()``
    the first time (a process keeps one per backend), or (None, why it did not open)."""
    key = (backend, comm.rank, comm.size)
    if key not in _group_cache:
        try:
            group = init()
        except (RuntimeError, OSError) as error:
            return None, f"MLX's {backend} backend did not start: {error}"
        if (group.rank(), group.size()) != (comm.rank, comm.size):
            return None, (f"MLX's {backend} group is {group.rank()}/{group.size()}, "
                          "not this communicator")
        _group_cache[key] = group
    return _group_cache[key], None


def _init_mlx(backend: str, environment: dict):
    """mx.distributed.init(backend) with ``environment`` set for the call only (MLX reads
    its backends' settings from variables)."""
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        return mx.distributed.init(strict=True, backend=backend)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _init_mpi(comm, library):
    """MLX's MPI backend through the adapter ``library``, bound first to a duplicate of
    ``comm`` (collective)."""
    mpi_abi.bind(comm.mpi, library)
    return _init_mlx("mpi", {"MLX_MPI_LIBNAME": str(library)})


def _init_ring(rank: int, ring: RingAddresses):
    """MLX's ring backend from a hostfile this rank writes for itself."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="spmd-cp-ring-") as hostfile:
        hostfile.write(ring.hostfile_json())
        hostfile.flush()
        return _init_mlx("ring", {"MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile.name})
