"""A small process beside rank 0 that answers the waiting clients when rank 0 dies.

When any rank dies, the launcher ends every other rank at once (MPICH's mpiexec kills
them with SIGKILL within milliseconds; a watchdog abort ends them all the same way), so
rank 0 itself cannot answer the clients it was serving: they would see their connection
closed with no response. The guardian is a separate process, started by rank 0 in a
session of its own (the launcher's kill does not reach it), that holds a duplicate of
every client connection waiting for an answer, passed over a Unix socket. A duplicate
keeps the connection open when rank 0's copy closes with its process; the guardian then
answers it: a 503 with OpenAI's error body, or, where a stream's 200 already went out,
an error event in the stream. Rank 0 tells it which connections are waiting, which have
begun streaming and which are done; the end of that socket (rank 0's process gone, or
its clean stop) is the guardian's signal to answer what it still holds and exit.

Standard library only: it runs as `python -m spmd_cp.server.guardian FD`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

RANK_LOST = {"error": {
    "message": "the server lost one of its ranks (a process ended or was killed) and is "
               "stopping; see the server's log, then start it again",
    "type": "server_error", "param": None, "code": "rank_lost"}}
SHUTTING_DOWN = {"error": {"message": "the server is shutting down", "type": "server_error",
                           "param": None, "code": "shutting_down"}}
MAX_MESSAGE = 256


class GuardianLink:
    """Rank 0's end: start the guardian, tell it about connections. Every call is best
    effort: a guardian that failed costs the clients their 503, never a request."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.lock = threading.Lock()
        self.next_id = 0
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spmd_cp.server.guardian", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                start_new_session=True)

    def send(self, message: str, fds=()) -> bool:
        with self.lock:
            try:
                socket.send_fds(self.sock, [message.encode()], list(fds))
                return True
            except OSError:
                return False

    def hold(self, connection: socket.socket) -> int | None:
        """Pass a duplicate of a waiting client's connection; its id, for the calls below."""
        with self.lock:
            self.next_id += 1
            ident = self.next_id
        return ident if self.send(f"hold {ident}", [connection.fileno()]) else None

    def streaming(self, ident: int | None):
        if ident is not None:
            self.send(f"streaming {ident}")

    def release(self, ident: int | None):
        if ident is not None:
            self.send(f"release {ident}")

    def close(self):
        """A clean stop: what the guardian still holds gets "shutting down", not "lost"."""
        self.send("stopping")
        self.sock.close()


def answer(connection: socket.socket, streaming: bool, body: dict):
    """Rank 0 cannot: a 503 (or an error event where the stream has begun), then close."""
    data = json.dumps(body).encode()
    if streaming:
        reply = b"data: " + data + b"\n\n"
    else:
        reply = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
    try:
        connection.settimeout(5)
        connection.sendall(reply)
        connection.shutdown(socket.SHUT_WR)
    except OSError:  # the client is gone, or rank 0 finished this one after all
        pass
    finally:
        connection.close()


def guard(link: socket.socket):
    """The guardian's loop: track the held connections until rank 0's end closes."""
    held: dict[int, list] = {}  # id -> [connection, streaming]
    body = RANK_LOST
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(link, MAX_MESSAGE, 4)
        except OSError:
            message, fds = b"", []
        if not message:
            break
        verb, _, ident = message.decode().partition(" ")
        if verb == "hold" and fds:
            held[int(ident)] = [socket.socket(fileno=fds[0]), False]
        elif verb == "streaming" and int(ident) in held:
            held[int(ident)][1] = True
        elif verb == "release" and int(ident) in held:
            held.pop(int(ident))[0].close()
        elif verb == "stopping":
            body = SHUTTING_DOWN
    for connection, streaming in held.values():
        answer(connection, streaming, body)


def main():
    link = socket.socket(fileno=int(sys.argv[1]))
    guard(link)
    os._exit(0)


if __name__ == "__main__":
    main()
