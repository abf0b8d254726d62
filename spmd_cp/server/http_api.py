"""Rank 0's HTTP side: a stdlib ThreadingHTTPServer whose handler threads check requests,
queue them for rank 0's main thread and relay its answer (JSON, or server-sent events).

Nothing here touches MLX or MPI. A handler thread and the main thread meet in a
``Pending``: the main thread puts ("start" | "text" | "done" | "error", value) events
on it; the handler sets ``cancelled`` when its client has gone (a failed write, or the
socket closed while waiting), and the main thread stops that generation at its next token.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .guardian import RANK_LOST
from .openai_api import ApiError, chunk, full_response, parse_json, parse_request, usage_chunk

log = logging.getLogger("spmd_cp")
MAX_BODY_BYTES = 64 << 20
POLL_S = 0.25  # how often a waiting handler looks at its client's socket
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class Pending:
    """One queued request, between its handler thread and rank 0's main thread."""

    def __init__(self, request):
        self.request = request
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.guard_id = None  # its connection's id at the guardian (server/guardian.py)

    def start(self):
        self.events.put(("start", None))

    def emit(self, text: str):
        self.events.put(("text", text))

    def done(self, text: str, finish_reason: str, counts: dict):
        self.events.put(("done", (text, finish_reason, counts)))

    def fail(self, error: ApiError):
        self.events.put(("error", error))


class ServerState:
    """What the handlers share with the main thread."""

    def __init__(self, defaults, api_key: str | None):
        self.defaults = defaults  # SamplingConfig: the server's flags
        self.api_key = api_key
        self.model_id = "spmd-cp"
        self.queue: queue.Queue = queue.Queue()
        self.ready = threading.Event()  # the model is loaded on every rank
        self.stopping = threading.Event()
        self.busy = False
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
                "busy": self.busy, "requests_served": self.served,
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


class Handler(BaseHTTPRequestHandler):
    server_version = "spmd-cp"
    state: ServerState  # set on the subclass make_server builds

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("http: %s - %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------------------
    def send_json(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_api_error(self, error: ApiError):
        self.send_json(error.status, error.body())

    def authorized(self) -> bool:
        key = self.state.api_key
        if key is None or self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self.send_api_error(ApiError(401, "invalid or missing API key (Authorization: "
                                          "Bearer ...)", code="invalid_api_key"))
        return False

    def read_body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header is required") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
        return parse_json(self.rfile.read(length))

    # -- routes ------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 - http.server's name
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/health":
            health = self.state.health()
            return self.send_json(200 if health["status"] == "ok" else 503, health)
        if not self.authorized():
            return
        if path in ("/v1/models", "/models"):
            model = {"id": self.state.model_id, "object": "model", "created": 0,
                     "owned_by": "spmd-cp"}
            return self.send_json(200, {"object": "list", "data": [model]})
        self.send_api_error(ApiError(404, f"no route GET {path}", code="not_found"))

    def do_POST(self):  # noqa: N802
        path = urlsplit(self.path).path.rstrip("/")
        if not self.authorized():
            return
        kind = ROUTES.get(path) or ROUTES.get("/v1" + path)
        if kind is None:
            return self.send_api_error(ApiError(404, f"no route POST {path}", code="not_found"))
        try:
            request = parse_request(kind, self.read_body(), self.state.defaults)
        except ApiError as error:
            return self.send_api_error(error)
        if self.state.stopping.is_set():
            return self.send_api_error(shutting_down())
        pending = Pending(request)
        guardian = self.state.guardian
        if guardian is not None:
            pending.guard_id = guardian.hold(self.connection)
        self.state.queue.put(pending)
        try:
            (self.stream if request.stream else self.answer)(pending)
        except OSError:  # the client went away while we wrote
            pending.cancelled.set()
        finally:
            if guardian is not None:
                guardian.release(pending.guard_id)

    # -- answers -----------------------------------------------------------------------
    def next_event(self, pending: Pending):
        """The main thread's next event, or None once the client has gone."""
        while True:
            try:
                return pending.events.get(timeout=POLL_S)
            except queue.Empty:
                if peer_closed(self.connection):
                    pending.cancelled.set()
                    return None

    def answer(self, pending: Pending):
        while (event := self.next_event(pending)) is not None:
            kind, value = event
            if kind == "error":
                return self.send_api_error(value)
            if kind == "done":
                text, finish, counts = value
                return self.send_json(200, full_response(pending.request, self.state.model_id,
                                                         text, finish, counts))

    def stream(self, pending: Pending):
        request, model = pending.request, self.state.model_id
        while (event := self.next_event(pending)) is not None:
            kind, value = event
            if kind == "error":
                return self.send_api_error(value)
            if kind == "start":
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                if self.state.guardian is not None:
                    self.state.guardian.streaming(pending.guard_id)
                if request.kind == "chat":
                    self.send_event(chunk(request, model, first=True))
            elif kind == "text":
                self.send_event(chunk(request, model, text=value))
            elif kind == "done":
                _, finish, counts = value
                self.send_event(chunk(request, model, finish_reason=finish))
                if request.include_usage:
                    self.send_event(usage_chunk(request, model, counts))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                return

    def send_event(self, body: dict):
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error",
                    code="shutting_down")


def rank_lost() -> ApiError:
    """The answer where the job ends on a failure (a rank gone, an abort): the one the
    guardian gives where rank 0 itself is gone first."""
    error = RANK_LOST["error"]
    return ApiError(503, error["message"], kind=error["type"], code=error["code"])


def make_server(host: str, port: int, state: ServerState) -> ThreadingHTTPServer:
    """Bind (OSError when the address is taken); serve with ``serve_forever``."""
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def start(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="spmd-cp-http", daemon=True)
    thread.start()
    return thread
