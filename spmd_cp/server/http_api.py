"""Rank 0's HTTP side: a stdlib ThreadingHTTPServer whose handler threads check requests,
queue them for rank 0's main thread and relay its answer (JSON, or server-sent events).

Nothing here touches MLX or MPI. A handler thread and the main thread meet in a
``Pending`` (one a choice where a request asks for ``n``: server/choices.py): the main
thread puts ("start" | "text" | "done" | "error", value, the choice's index) events on
the handler's queue; the handler sets ``cancelled`` when its client has gone (a failed
write, or the socket closed while waiting), and the main thread stops that generation at
its next token.

Every client gets an HTTP answer, however many come at once: the kernel holds
``LISTEN_BACKLOG`` connections not yet accepted (the standard library's 5 turned the
rest away with a reset); ``MAX_HANDLERS`` connections are served at once, and beyond them
up to ``MAX_REFUSERS`` more are answered 503 ``server_overloaded`` (beyond those, new
connections wait in the backlog); ``MAX_QUEUED`` requests wait for the ranks, a request
beyond them is answered 429 ``queue_full``. A client that sends nothing for
``READ_TIMEOUT_S`` is closed, so stalled clients cannot hold the handlers. A client
that leaves before its request is read costs one log line, not a traceback.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from . import choices
from .guardian import RANK_LOST
from .openai_api import ApiError, parse_json, parse_request

log = logging.getLogger("spmd_cp")
MAX_BODY_BYTES = 64 << 20
LISTEN_BACKLOG = 128  # connections the kernel holds until they are accepted
MAX_HANDLERS = 64  # connections served at once, a thread each (the queued requests' too)
MAX_REFUSERS = 16  # beyond those, connections answered 503 at once
MAX_QUEUED = 32  # requests waiting for the ranks (one more is being answered)
READ_TIMEOUT_S = 30.0  # a client silent this long while we read (or write) is closed
DISCARD_BYTES = 1 << 20  # the most of an unread body read and dropped before a refusal
POLL_S = 0.25  # how often a waiting handler looks at its client's socket
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class Pending:
    """One queued request (a choice of one), between its handler thread and rank 0's
    main thread. ``events``: its handler's queue, shared by a request's choices."""

    def __init__(self, request, events: queue.Queue | None = None):
        self.request = request
        self.index = request.index  # its choice
        self.events: queue.Queue = events if events is not None else queue.Queue()
        self.cancelled = threading.Event()
        self.guard_id = None  # its connection's id at the guardian (server/guardian.py)

    def start(self):
        self.events.put(("start", None, self.index))

    def emit(self, text: str):
        self.events.put(("text", text, self.index))

    def done(self, text: str, finish_reason: str, counts: dict):
        self.events.put(("done", (text, finish_reason, counts), self.index))

    def fail(self, error: ApiError):
        self.events.put(("error", error, self.index))


class ServerState:
    """What the handlers share with the main thread."""

    def __init__(self, defaults, api_key: str | None, max_queued: int = MAX_QUEUED):
        self.defaults = defaults  # SamplingConfig: the server's flags
        self.api_key = api_key
        self.model_id = "spmd-cp"
        self.queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.ready = threading.Event()  # the model is loaded on every rank
        self.stopping = threading.Event()
        self.busy = False
        self.running = 0  # requests decoding now
        self.max_batch = 1  # the most decoded together (serve --max-batch)
        self.cache = {"entries": 0, "bytes": 0, "tokens": 0}
        self.memory = []  # per rank, after the last request: resident and MLX bytes
        self.memory_forecast = {}  # the last request's forecast per rank, by part
        self.served = 0
        self.cancelled = 0  # requests whose client went away before the answer's end
        self.guardian = None  # GuardianLink: answers the waiting clients if rank 0 dies

    def drain(self, error: ApiError):
        """Answer what is still queued with ``error`` (a 503: the server is stopping)."""
        self.stopping.set()
        while True:
            try:
                self.queue.get_nowait().fail(error)
            except queue.Empty:
                return

    def health(self) -> dict:
        status = "stopping" if self.stopping.is_set() else "ok" if self.ready.is_set() \
            else "loading"
        return {"status": status, "model": self.model_id, "queue_length": self.queue.qsize(),
                "busy": self.busy, "running": self.running, "max_batch": self.max_batch,
                "requests_served": self.served,
                "requests_cancelled": self.cancelled, "cache": dict(self.cache),
                "memory": [dict(rank) for rank in self.memory],
                "memory_forecast": dict(self.memory_forecast)}


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its end (it sends nothing more after its request)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class ClientGone(Exception):
    """The client closed its connection before its request was read."""


class Handler(BaseHTTPRequestHandler):
    server_version = "spmd-cp"
    state: ServerState  # set on the subclass make_server builds
    timeout = READ_TIMEOUT_S  # the socket's, for every read and write (socketserver)
    overloaded = False  # True on the handler of a connection beyond MAX_HANDLERS

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("http: %s - %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------------------
    def send_json(self, status: int, body: dict, headers: dict | None = None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def send_api_error(self, error: ApiError):
        self.send_json(error.status, error.body())

    def key_given(self) -> bool:
        key = self.state.api_key
        return key is None or self.headers.get("Authorization", "") == f"Bearer {key}"

    def read_body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header is required") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise ApiError(408, f"no data for {self.timeout:g} s while reading the request "
                                f"body", code="request_timeout") from None
        if len(raw) < length:
            raise ClientGone(f"closed after {len(raw)} of {length} body bytes")
        return parse_json(raw)

    def discard_body(self):
        """Read and drop a POST body this handler refuses unread (up to DISCARD_BYTES):
        closing a socket with unread bytes sends a reset, which can reach the client
        before the refusal does."""
        try:
            length = min(int(self.headers.get("Content-Length", "0")), DISCARD_BYTES)
            self.rfile.read(max(length, 0))
        except (ValueError, OSError):
            pass

    def refuse(self, error: ApiError, headers: dict | None = None):
        """Answer ``error`` to a request whose body is still unread."""
        self.discard_body()
        self.send_json(error.status, error.body(), headers)

    # -- routes ------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 - http.server's name
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/health":
            health = self.state.health()
            return self.send_json(200 if health["status"] == "ok" else 503, health)
        if not self.key_given():
            return self.send_api_error(invalid_api_key())
        if path in ("/v1/models", "/models"):
            model = {"id": self.state.model_id, "object": "model", "created": 0,
                     "owned_by": "spmd-cp"}
            return self.send_json(200, {"object": "list", "data": [model]})
        self.send_api_error(ApiError(404, f"no route GET {path}", code="not_found"))

    def do_POST(self):  # noqa: N802
        path = urlsplit(self.path).path.rstrip("/")
        if self.overloaded:
            return self.refuse(server_overloaded(), {"Retry-After": "1"})
        if not self.key_given():
            return self.refuse(invalid_api_key())
        kind = ROUTES.get(path) or ROUTES.get("/v1" + path)
        if kind is None:
            return self.refuse(ApiError(404, f"no route POST {path}", code="not_found"))
        try:
            request = parse_request(kind, self.read_body(), self.state.defaults)
        except ApiError as error:
            return self.send_api_error(error)
        except ClientGone as gone:
            log.info("http: %s %s", self.address_string(), gone)
            self.close_connection = True
            return
        if self.state.stopping.is_set():
            return self.send_api_error(shutting_down())
        events: queue.Queue = queue.Queue()
        pendings = [Pending(choice, events) for choice in choices.choice_requests(request)]
        guardian = self.state.guardian
        guard_id = guardian.hold(self.connection) if guardian is not None else None
        for pending in pendings:
            pending.guard_id = guard_id
        try:
            for pending in pendings:
                self.state.queue.put_nowait(pending)
        except queue.Full:  # the choices queued already are dropped as cancelled
            choices.cancel(pendings)
            if guardian is not None:
                guardian.release(guard_id)
            return self.send_api_error(queue_full(self.state.queue.maxsize))
        try:
            (choices.stream if request.stream else choices.answer)(self, pendings)
        except OSError:  # the client went away while we wrote
            choices.cancel(pendings)
        finally:
            if guardian is not None:
                guardian.release(guard_id)

    # -- answers (server/choices.py composes them) ------------------------------------
    def next_event(self, pendings: list[Pending]):
        """The main thread's next event for this request's choices, or None once the
        client has gone (every choice cancelled)."""
        while True:
            try:
                return pendings[0].events.get(timeout=POLL_S)
            except queue.Empty:
                if peer_closed(self.connection):
                    choices.cancel(pendings)
                    return None

    def start_events(self, pending: Pending):
        """A stream's headers, once its first choice starts."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        if self.state.guardian is not None:
            self.state.guardian.streaming(pending.guard_id)

    def send_event(self, body: dict):
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error",
                    code="shutting_down")


def invalid_api_key() -> ApiError:
    return ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                    code="invalid_api_key")


def server_overloaded() -> ApiError:
    return ApiError(503, "the server is serving as many connections as it may at once; "
                         "retry later", kind="server_error", code="server_overloaded")


def queue_full(size: int) -> ApiError:
    return ApiError(429, f"{size} requests are waiting already; retry later",
                    kind="rate_limit_error", code="queue_full")


def rank_lost() -> ApiError:
    """The answer where the job ends on a failure (a rank gone, an abort): the one the
    guardian gives where rank 0 itself is gone first."""
    error = RANK_LOST["error"]
    return ApiError(503, error["message"], kind=error["type"], code=error["code"])


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with a listen backlog and a bounded number of threads:
    ``max_handlers`` serve, ``max_refusers`` more answer 503; with both taken, accepting
    waits for a handler (new connections wait in the kernel's backlog)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, address, handler, max_handlers: int, max_refusers: int):
        super().__init__(address, handler)
        self.serving = threading.BoundedSemaphore(max_handlers)
        self.refusing = threading.BoundedSemaphore(max_refusers)
        self.refuser = type("Refusing" + handler.__name__, (handler,), {"overloaded": True})
        self.closing = threading.Event()

    def process_request(self, request, client_address):
        slot = self.take_slot()
        if slot is None:  # shutting down
            self.shutdown_request(request)
            return
        threading.Thread(target=self.serve_connection, args=(request, client_address, slot),
                         daemon=True).start()

    def take_slot(self) -> threading.BoundedSemaphore | None:
        for slot in (self.serving, self.refusing):
            if slot.acquire(blocking=False):
                return slot
        while not self.closing.is_set():
            if self.serving.acquire(timeout=0.2):
                return self.serving
        return None

    def serve_connection(self, request, client_address, slot):
        handler = self.refuser if slot is self.refusing else self.RequestHandlerClass
        try:
            handler(request, client_address, self)
        except Exception:  # noqa: BLE001 - socketserver's own catch-all, logged below
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            slot.release()

    def handle_error(self, request, client_address):
        """A client that left or went silent: one line; anything else: the traceback,
        in the log (socketserver prints it to stderr)."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.info("http: %s: the client left (%s)", client_address[0],
                     type(error).__name__)
        else:
            log.error("http: the handler of %s failed", client_address[0], exc_info=True)

    def shutdown(self):
        self.closing.set()
        super().shutdown()


def make_server(host: str, port: int, state: ServerState, max_handlers: int = MAX_HANDLERS,
                max_refusers: int = MAX_REFUSERS,
                read_timeout: float = READ_TIMEOUT_S) -> BoundedHTTPServer:
    """Bind (OSError when the address is taken); serve with ``serve_forever``."""
    handler = type("BoundHandler", (Handler,), {"state": state, "timeout": read_timeout})
    return BoundedHTTPServer((host, port), handler, max_handlers, max_refusers)


def start(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="spmd-cp-http", daemon=True)
    thread.start()
    return thread
