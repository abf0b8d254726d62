"""The communicator every CP algorithm is handed: mpi4py underneath, MLX arrays on top.

Nothing below the CLI touches ``MPI.COMM_WORLD``: the CLI wraps a communicator in a
``Comm`` and passes it down, so CP and TP groups can later be split from it.

Byte counting: ``bytes_sent`` is the payload this rank hands to *other* ranks, counted
logically per destination (an Allgather of b bytes over N ranks counts (N-1)*b, a
Sendrecv b, a Bcast from the root (N-1)*b). docs/ALGORITHMS.md gives the analytic
volume of each algorithm in the same unit, and tests check the two agree.
"""

from __future__ import annotations

import pickle
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from ..errors import UserError
from .watchdog import ABORT_GRACE_S

# MPI has no bfloat16: such arrays travel as their raw 16-bit patterns.
_WIRE_VIEW = {mx.bfloat16: mx.uint16}


def require_thread_multiple(provided: int, required: int, size: int):
    """Refuse an MPI that cannot take calls from two threads at once (several ranks).

    The ring's Sendrecv runs on a communication thread while the main thread (and the
    watchdog's probes) call MPI too: that needs MPI_THREAD_MULTIPLE, which mpi4py
    requests by default but an MPI build, or ``mpi4py.rc.thread_level``, may refuse.
    """
    if size > 1 and provided < required:
        raise UserError(
            f"MPI provides thread level {provided}, below MPI_THREAD_MULTIPLE ({required}), "
            "which spmd-cp needs on more than one rank (its communication thread calls MPI "
            "while the main thread does): use an MPI built with thread support "
            "(the mpich wheel is) and leave mpi4py.rc.thread_level at 'multiple'")


def to_wire(array: mx.array) -> np.ndarray:
    """An evaluated, contiguous numpy view of ``array`` that MPI can send (no copy)."""
    array = mx.contiguous(array.view(_WIRE_VIEW.get(array.dtype, array.dtype)))
    mx.eval(array)
    return np.asarray(array)


def from_wire(buffer: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """The MLX array for a received buffer (one copy), undoing ``to_wire``'s view."""
    array = mx.array(buffer)
    return array.view(dtype) if dtype in _WIRE_VIEW else array


class Transfer:
    """A Sendrecv running on the communication thread; ``wait()`` returns what arrived.

    The send buffer is referenced until the transfer completes (MPI reads it meanwhile).
    """

    def __init__(self, future, send: np.ndarray, recv: np.ndarray, dtype: mx.Dtype, waiting):
        self._future, self._send, self._recv, self._dtype = future, send, recv, dtype
        self._waiting = waiting  # the watchdog context for this wait
        self._done = False

    def wait(self) -> mx.array:
        if self._done:
            raise RuntimeError("Transfer.wait() called twice")
        with self._waiting:
            self._future.result()
        self._done = True
        self._send = None
        return from_wire(self._recv, self._dtype)


class Comm:
    """A thin, counting wrapper over an mpi4py intracommunicator."""

    def __init__(self, mpi_comm, watchdog=None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        if self.size > 1:
            from mpi4py import MPI

            require_thread_multiple(MPI.Query_thread(), MPI.THREAD_MULTIPLE, self.size)
        # Ring neighbours, computed once (ring-flash-attention's RingComm): this rank
        # sends to ring_next and receives from ring_prev.
        self.ring_next = (self.rank + 1) % self.size
        self.ring_prev = (self.rank - 1) % self.size
        self.bytes_sent = 0
        # Of those, pass-KV's for sliding-window layers (attention/window.py), and what a
        # full ring would have forwarded for the same layers: the saving is the difference.
        self.window_kv_bytes = 0
        self.window_kv_ring_bytes = 0
        self.wait_seconds = 0.0  # time spent blocked in communication (not overlapped)
        self.watchdog = watchdog  # bounds every blocking call below (see watchdog.py)
        self.tracer = None  # records waits and transfers when --trace is on (trace.py)
        self._comm_thread = None

    @contextmanager
    def _waiting(self, what: str, peer: int | None = None):
        """Around every blocking call: time it, and let the watchdog bound it."""
        start = time.perf_counter()
        try:
            if self.watchdog is None or self.size == 1:
                yield
            else:
                with self.watchdog.waiting(what, peer):
                    yield
        finally:
            end = time.perf_counter()
            self.wait_seconds += end - start
            if self.tracer is not None:
                self.tracer.complete(f"wait: {what}", "wait", start, end, peer=peer)

    def waiting(self, what: str, peer: int | None = None):
        """``_waiting`` for a blocking call made outside this class (runtime/afd.py's
        exchanges over a communicator of another shape)."""
        return self._waiting(what, peer)

    @contextmanager
    def bounded(self, what: str):
        """Around a blocking call that is not communication alone (an evaluation that runs
        graph collectives, runtime/graph_comm.py): the watchdog bounds it, but its time is
        not counted as waiting."""
        if self.watchdog is None or self.size == 1:
            yield
        else:
            with self.watchdog.waiting(what):
                yield

    def sendrecv_start(self, array: mx.array, dest: int, source: int,
                       recv_shape: tuple) -> Transfer:
        """Start sending ``array`` to ``dest`` while receiving ``recv_shape`` from ``source``.

        A Python thread runs the blocking Sendrecv while the caller keeps MLX busy: MLX
        releases the GIL during evaluation, and over TCP this overlapped better than
        Isend/Irecv + Wait or Testall polling (figures: docs/ALGORITHMS.md, "Overlap";
        the threads: docs/ARCHITECTURE.md). Only this thread talks MPI until ``wait()``,
        but the watchdog may probe meanwhile: hence MPI_THREAD_MULTIPLE, checked in
        ``__init__``.
        """
        if self._comm_thread is None:
            self._comm_thread = ThreadPoolExecutor(1, thread_name_prefix="spmd-cp-comm")
        send = to_wire(array)
        recv = np.empty(recv_shape, dtype=send.dtype)
        future = self._comm_thread.submit(self._sendrecv, send, dest, recv, source)
        self.bytes_sent += send.nbytes
        return Transfer(future, send, recv, array.dtype, self._waiting("ring Sendrecv", source))

    def _sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int):
        """The blocking Sendrecv, run on the communication thread."""
        start = time.perf_counter()
        self.mpi.Sendrecv(send, dest, 0, recv, source, 0)
        if self.tracer is not None:
            self.tracer.complete("transfer", "transfer", start, time.perf_counter(), thread=1,
                                 to=dest, source=source, bytes=int(send.nbytes))

    def alltoallv_arrays(self, arrays: list, recv_shapes: list) -> list:
        """Send ``arrays[r]`` to rank r; return the arrays received from each rank.

        The piece for this rank itself stays local (and is not counted as sent).
        """
        dtype = arrays[0].dtype
        sends = [to_wire(a) for a in arrays]
        send = np.concatenate([s.reshape(-1) for s in sends]) if sends else np.zeros(0)
        send_counts = [s.size for s in sends]
        recv_counts = [int(np.prod(shape, dtype=np.int64)) for shape in recv_shapes]
        recv = np.empty(sum(recv_counts), dtype=send.dtype)
        if self.size == 1:
            recv[:] = send
        else:
            with self._waiting("Alltoallv"):
                self.mpi.Alltoallv([send, (send_counts, offsets(send_counts))],
                                   [recv, (recv_counts, offsets(recv_counts))])
        self.bytes_sent += sum(s.nbytes for r, s in enumerate(sends) if r != self.rank)
        pieces = np.split(recv, np.cumsum(recv_counts)[:-1])
        return [from_wire(p.reshape(shape), dtype) for p, shape in zip(pieces, recv_shapes)]

    # -- small Python objects (control plane) ------------------------------------
    def bcast_object(self, obj, root: int = 0):
        if self.size == 1:
            return obj
        if self.rank == root:
            self.bytes_sent += (self.size - 1) * len(pickle.dumps(obj))
        with self._waiting("Bcast", None if self.rank == root else root):
            return self.mpi.bcast(obj, root=root)

    def allgather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        self.bytes_sent += (self.size - 1) * len(pickle.dumps(obj))
        with self._waiting("Allgather"):
            return self.mpi.allgather(obj)

    def gather_object(self, obj, root: int = 0):
        if self.size == 1:
            return [obj]
        if self.rank != root:
            self.bytes_sent += len(pickle.dumps(obj))
        with self._waiting("Gather", None if self.rank == root else root):
            return self.mpi.gather(obj, root=root)

    # -- MLX arrays (data plane) ---------------------------------------------------
    def allgather_rows(self, array: mx.array, axis: int, counts=None) -> mx.array:
        """Concatenate every rank's ``array`` along ``axis`` (sizes may differ per rank).

        All other dimensions must agree. Ranks contribute in rank order. ``counts``
        (every rank's size along ``axis``), when the caller knows them, saves a round.
        """
        if self.size == 1:
            return array
        send = to_wire(mx.moveaxis(array, axis, 0))
        row_shape = send.shape[1:]
        if counts is None:
            with self._waiting("Allgather"):
                counts = self.mpi.allgather(send.shape[0])
        row_elems = int(np.prod(row_shape, dtype=np.int64))
        recv = np.empty((sum(counts),) + row_shape, dtype=send.dtype)
        sizes = [c * row_elems for c in counts]
        with self._waiting("Allgatherv"):
            self.mpi.Allgatherv(send, [recv, (sizes, offsets(sizes))])
        self.bytes_sent += (self.size - 1) * send.nbytes
        return mx.moveaxis(from_wire(recv, array.dtype), 0, axis)

    def gather_rows(self, array: mx.array, counts: list, root: int = 0):
        """Concatenate every rank's 1-D ``array`` (``counts[r]`` long) on ``root`` only."""
        if self.size == 1:
            return array
        send = to_wire(array)
        recv = np.empty(sum(counts), dtype=send.dtype) if self.rank == root else None
        with self._waiting("Gatherv", None if self.rank == root else root):
            self.mpi.Gatherv(send, [recv, (list(counts), offsets(counts))] if recv is not None
                             else None, root=root)
        if self.rank != root:
            self.bytes_sent += send.nbytes
            return None
        return from_wire(recv, array.dtype)

    def allgather_stack(self, array: mx.array) -> mx.array:
        """Stack every rank's same-shaped ``array`` into a new leading axis of size N."""
        if self.size == 1:
            return array[None]
        send = to_wire(array)
        recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        with self._waiting("Allgather"):
            self.mpi.Allgather(send, recv)
        self.bytes_sent += (self.size - 1) * send.nbytes
        return from_wire(recv, array.dtype)

    def allreduce_onto(self, base: mx.array, array: mx.array) -> mx.array:
        """``base`` plus the sum of every rank's ``array`` (a residual and the pieces of a
        row-parallel projection)."""
        return base + self.allreduce(array, "sum")

    def allreduce(self, array: mx.array, op: str) -> mx.array:
        """Elementwise ``op`` ("sum" or "max") over every rank's same-shaped ``array``.

        Counted as 2 * (N-1)/N * nbytes per rank: what the bandwidth-optimal algorithm
        (reduce-scatter, then allgather of the reduced pieces) sends, and the least any
        algorithm can send; MPICH's algorithm for large messages. For small ones recursive
        doubling sends log2(N) * nbytes, a little more than counted (equal at N = 2).
        """
        from mpi4py import MPI

        send = to_wire(array)
        recv = np.empty_like(send)
        with self._waiting("Allreduce"):
            self.mpi.Allreduce(send, recv, op={"sum": MPI.SUM, "max": MPI.MAX}[op])
        self.bytes_sent += 2 * (self.size - 1) * send.nbytes // self.size
        return from_wire(recv, array.dtype)

    def send_array(self, array: mx.array, dest: int):
        """Send ``array`` to ``dest``, which gets it back with ``recv_array``: the shape and
        the dtype travel with it."""
        send = to_wire(array)
        with self._waiting("Send", dest):
            self.mpi.send((send.shape, send.dtype.str, _dtype_name(array.dtype)), dest=dest)
            self.mpi.Send(send, dest=dest)
        self.bytes_sent += send.nbytes

    def recv_array(self, source: int) -> mx.array:
        with self._waiting("Recv", source):
            shape, wire_dtype, dtype_name = self.mpi.recv(source=source)
            recv = np.empty(shape, dtype=np.dtype(wire_dtype))
            self.mpi.Recv(recv, source=source)
        return from_wire(recv, getattr(mx, dtype_name))

    def barrier(self):
        if self.size > 1:
            with self._waiting("Barrier"):
                self.mpi.Barrier()

    def abort(self, code: int = 1):
        """End every rank (MPI_Abort), once what this rank wrote has had time to reach the
        launcher (watchdog.ABORT_GRACE_S)."""
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        self.mpi.Abort(code)


def _dtype_name(dtype: mx.Dtype) -> str:
    """'bfloat16' for mx.bfloat16: a name that pickles, and ``getattr(mx, name)`` undoes."""
    return str(dtype).rsplit(".", 1)[-1]


def offsets(counts) -> list[int]:
    """The displacements of consecutive blocks of ``counts`` (a v-collective's)."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
