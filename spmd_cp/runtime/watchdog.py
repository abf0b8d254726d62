"""A watchdog thread that ends the whole job when it would otherwise hang.

Two ways an MPI job hangs forever:
- a peer is gone (machine lost, network down, a rank stuck): the others block in a
  Sendrecv or collective that never completes. Every blocking call runs inside
  ``watchdog.waiting(what, peer)``; if one lasts longer than ``timeout`` the watchdog
  names what it waited for and calls MPI_Abort, which ends every rank.
- Ctrl-C: mpiexec forwards SIGINT (Open MPI's mpirun sends SIGTERM, read the same
  way), but a rank blocked inside an MPI call never returns to Python to raise
  KeyboardInterrupt. Python's C-level signal handler still writes the signal number to
  the wakeup fd, which this thread watches, so it can abort.

Naming the culprit: the peer a rank waits on is often a victim too (in a ring, rank 1
waits on rank 0, which waits on the hung rank 2). So before aborting, the watchdog asks
every other rank's watchdog thread, over its own duplicated communicator, what its rank
is doing. A rank that does not answer is dead or unreachable; one that answers but is
not inside a communication call is stuck computing. Those are the ones named.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager

EXIT_INTERRUPTED = 130
EXIT_COMM_TIMEOUT = 124
_PROBE, _REPLY = 1, 2
PROBE_WAIT_S = 3.0
# Between a rank's last words and MPI_Abort: the abort makes the launcher kill every
# process, its output proxies included, and a line still in the pipe to the proxy is lost
# (seen: about 1 Ctrl-C in 6 during decode ended with status 130 and no message).
ABORT_GRACE_S = 0.2


class Watchdog:
    def __init__(self, rank: int, size: int, abort, timeout: float = 600.0):
        """``abort(code)`` must end every rank (MPI_Abort); ``timeout`` 0 disables it."""
        self.rank, self.size = rank, size
        self.abort = abort
        self.timeout = timeout
        self.context = "start-up"  # what the program is doing, for the message
        self._waiting = None  # (what, peer, since)
        self._busy_since = time.monotonic()  # when the last blocking call ended
        self._read_fd = None
        self._thread = None
        self._probes = None  # a private communicator for "what are you doing?" probes
        # on_interrupt(signal number) -> True when the program stops by itself (a server
        # finishing its request, then exiting 0): the watchdog then does not abort.
        self.on_interrupt = None

    def start(self, mpi_comm=None):
        """Start watching (call from the main thread: it installs the signal wakeup fd).

        With ``mpi_comm`` (collective: every rank must pass it), a timeout also asks the
        other ranks what they are doing.
        """
        if self._thread is not None:
            return
        if mpi_comm is not None and self.size > 1:
            from mpi4py import MPI

            self._probes = mpi_comm.Dup()
            self._probes.Set_errhandler(MPI.ERRORS_RETURN)  # a dead peer must not abort us
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        # Open MPI's mpirun answers Ctrl-C with SIGCONT and SIGTERM to every rank (Hydra
        # forwards the SIGINT): without a Python handler SIGTERM ends a rank silently,
        # before the wakeup fd hears of it. Read it as Ctrl-C unless the program chose
        # otherwise (serve installs its own).
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        self._read_fd = read_fd
        self._thread = threading.Thread(target=self._watch, name="spmd-cp-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self, what: str, peer: int | None = None):
        outer = self._waiting
        self._waiting = (what, peer, time.monotonic())
        try:
            yield
        finally:
            self._waiting = outer
            self._busy_since = time.monotonic()

    def status(self) -> tuple:
        """What this rank is doing, as answered to a probe."""
        waiting = self._waiting
        if waiting:
            return ("waiting", waiting[0], waiting[1], time.monotonic() - waiting[2])
        return ("busy", self.context, None, time.monotonic() - self._busy_since)

    def _watch(self):
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], 0.25)
            if ready:
                signals = os.read(self._read_fd, 64)
                for number in (signal.SIGINT, signal.SIGTERM):
                    if number in signals and not self._handled(number):
                        self._die(EXIT_INTERRUPTED, "interrupted; stopping all ranks")
            self._answer_probes()
            waiting = self._waiting
            if waiting and self.timeout > 0 and time.monotonic() - waiting[2] > self.timeout:
                what, peer, since = waiting
                waited = time.monotonic() - since
                self._die(EXIT_COMM_TIMEOUT,
                          f"waited {waited:.0f} s in {what} during {self.context}; "
                          f"{self._diagnose(peer)}; aborting the job "
                          f"(--comm-timeout {self.timeout:g})")

    def _handled(self, number: int) -> bool:
        handler = self.on_interrupt
        return handler is not None and bool(handler(number))

    def _answer_probes(self):
        if self._probes is None:
            return
        try:
            while self._probes.Iprobe(tag=_PROBE):
                from mpi4py import MPI

                info = MPI.Status()
                self._probes.recv(tag=_PROBE, status=info)
                self._probes.isend(self.status(), dest=info.Get_source(), tag=_REPLY)
        except Exception:  # noqa: BLE001 - probing is best effort
            pass

    def _diagnose(self, peer) -> str:
        """Ask every other rank what it is doing; name the ones that hold the job up."""
        fallback = (f"rank {peer} did not respond" if peer is not None
                    else "at least one other rank did not arrive")
        if self._probes is None:
            return fallback
        answers = {}
        try:
            for rank in range(self.size):
                if rank != self.rank:
                    self._probes.isend("status?", dest=rank, tag=_PROBE)
            deadline = time.monotonic() + PROBE_WAIT_S
            while len(answers) < self.size - 1 and time.monotonic() < deadline:
                self._answer_probes()  # others may be diagnosing too
                if self._probes.Iprobe(tag=_REPLY):
                    from mpi4py import MPI

                    info = MPI.Status()
                    answer = self._probes.recv(tag=_REPLY, status=info)
                    answers[info.Get_source()] = answer
                else:
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001
            return fallback
        culprits = []
        for rank in range(self.size):
            if rank == self.rank:
                continue
            if rank not in answers:
                culprits.append(f"rank {rank} does not answer (dead or unreachable)")
            elif answers[rank][0] == "busy" and answers[rank][3] > self.timeout / 2:
                culprits.append(f"rank {rank} has not communicated for {answers[rank][3]:.0f} s "
                                f"(stuck in {answers[rank][1]})")
        return "; ".join(culprits) if culprits else fallback

    def _die(self, code: int, message: str):
        sys.stderr.write(f"[rank {self.rank}/{self.size}] spmd-cp: {message}\n")
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        self.abort(code)
        os._exit(code)  # if abort returned (one rank): still end this process
