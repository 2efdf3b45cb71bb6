"""The HTTP side of ``persist serve``: a backlog that fits bursts, bounded requests, a drain.

mlx-lm's server listens with Python's default backlog of 5, so a burst of
simultaneous clients gets connection resets, and it stops on Ctrl-C by
tearing down the generation thread under requests still being answered.
This server (mlx-lm's handler, unchanged) listens with a configurable
backlog and stops in order on SIGTERM or SIGINT: stop accepting, let every
accepted request finish (up to a deadline; a response whose client reads
nothing for ``stalls.DRAIN_STALL`` seconds is cut off), stop generation, return, so the
caller flushes the write-behind queue and exits 0.  A second signal exits at
once (what a killed writer leaves, ``persist check --fix`` removes).  If the
generation thread stops for good (``GuardedGenerator``), the same orderly
stop runs and ``serve_until_signal`` raises, so the process exits non-zero
and a supervisor restarts it.  Every connection must send its whole request
within ``read_timeout`` seconds (``Deadlines``): a slow or stalled client is
answered 408 and closed, and holds no handler thread past that.  At most
``max_connections`` are open at once: past it the one sending its request
longest is closed with 503 (``Deadlines.evict_oldest``), so slow clients
cannot take every file descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

from ..errors import InvalidStateError
from .stalls import Stalls

__all__ = ["Deadlines", "DrainingServer", "serve_until_signal"]

log = logging.getLogger("persist")
TIMEOUT_BODY = b'{"error": {"message": "the request did not arrive in time", "type": "timeout"}}'
TIMEOUT_RESPONSE = (
    b"HTTP/1.0 408 Request Timeout\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(TIMEOUT_BODY), TIMEOUT_BODY)
)
BUSY_BODY = b'{"error": {"message": "too many connections", "type": "server_busy", "param": null}}'
BUSY_RESPONSE = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1"
    b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY)
)


def _answer_and_close(conn: socket.socket, response: bytes) -> None:
    """Send a short canned answer without waiting on the client, and shut it down."""
    try:
        conn.setblocking(False)  # a client that reads nothing never holds this thread
        conn.send(response)
    except OSError:
        pass  # the client has gone, or its window is full: it gets the close only
    with contextlib.suppress(OSError):  # already closed
        conn.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked reading it


class Deadlines:
    """Connections that must have sent their whole request by a deadline.

    A handler watches its connection when it starts and claims it (``done``)
    once the request is read; one reaper thread answers 408 to, and shuts
    down, every connection still watched past its deadline.  The socket
    timeout alone would not do: a client sending a byte every few seconds
    never lets one read time out.
    """

    def __init__(self, poll: float = 0.25, on_expire: Any = None) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[float, socket.socket]] = {}
        self._next = 0
        self._closed = threading.Event()
        self.poll, self.on_expire = poll, on_expire
        self._reaper = threading.Thread(target=self._run, name="persist-reaper", daemon=True)
        self._reaper.start()

    def watch(self, conn: socket.socket, seconds: float) -> int:
        with self._lock:
            self._next += 1
            self._live[self._next] = (time.monotonic() + seconds, conn)
            return self._next

    def done(self, token: int) -> bool:
        """Claim the connection: False if the reaper already answered and closed it."""
        with self._lock:
            return self._live.pop(token, None) is not None

    def evict_oldest(self) -> bool:
        """Answer 503 to, and shut down, the connection that has been sending its request
        longest (a slow client); False if every connection has sent its request."""
        with self._lock:
            if not self._live:
                return False
            token = min(self._live, key=lambda t: self._live[t][0])
            conn = self._live.pop(token)[1]
        _answer_and_close(conn, BUSY_RESPONSE)
        return True

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.poll):
            now = time.monotonic()
            with self._lock:
                late = [t for t, (when, _) in self._live.items() if when <= now]
                expired = [self._live.pop(t)[1] for t in late]
            for conn in expired:
                try:
                    conn.sendall(TIMEOUT_RESPONSE)
                    conn.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read
                except OSError:
                    pass  # the client has gone already
                if self.on_expire is not None:
                    self.on_expire()


class DrainingServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that counts requests in flight and can wait for them."""

    daemon_threads = True

    def __init__(
        self,
        address: Any,
        handler: Any,
        backlog: int,
        *,
        metrics: Any = None,
        read_timeout: float = 30.0,
        max_request_bytes: int = 4 << 20,
        max_connections: int = 128,
    ) -> None:
        self.request_queue_size = backlog  # listen(backlog), read by server_activate
        self.max_connections = max_connections
        self.in_flight = 0
        self._idle = threading.Condition()
        # what PersistHandler reads from its server
        self.metrics, self.read_timeout = metrics, read_timeout
        self.max_request_bytes = max_request_bytes
        expired = None if metrics is None else (lambda: metrics.request("incomplete", 408))
        self.deadlines = Deadlines(on_expire=expired)
        self.stalls = Stalls()  # responses being written: a drain cuts those nobody reads
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A handler's exception, into the log (socketserver prints it to stderr)."""
        import sys

        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):  # the client went away or stalled
            log.info("persist: connection from %s ended: %r", client_address[0], e)
        else:
            log.error("persist: a request from %s failed", client_address[0], exc_info=e)

    def connection_cap(self) -> int:
        """--max-connections, and never more than half the open-file limit: the model,
        the store and a new /health always have descriptors left."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        half = soft // 2 if soft != resource.RLIM_INFINITY else self.max_connections
        return max(1, min(self.max_connections, half))

    def process_request(self, request: Any, client_address: Any) -> None:
        # At the cap a slow client still sending its request makes room (oldest first):
        # many slow clients cannot take every connection; requests being served are kept.
        if self.in_flight >= self.connection_cap() and not self.deadlines.evict_oldest():
            _answer_and_close(request, BUSY_RESPONSE)
            self.shutdown_request(request)
            if self.metrics is not None:
                self.metrics.request("refused", 503)
            return
        with self._idle:  # counted before its thread starts: drain cannot miss it
            self.in_flight += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._idle:
            self.in_flight -= 1
            self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self.in_flight == 0, timeout)


def serve_until_signal(
    server_module: Any,
    host: str,
    port: int,
    response_generator: Any,
    *,
    backlog: int = 128,
    drain_timeout: float = 60.0,
    handler: Any = None,
    metrics: Any = None,
    read_timeout: float = 30.0,
    max_request_bytes: int = 4 << 20,
    max_connections: int = 128,
    pending: Callable[[], str | None] = lambda: None,
) -> None:
    """mlx-lm's ``_run_http_server`` with a real backlog, bounded requests and an orderly
    stop; InvalidStateError if it stopped because generation did (exit non-zero).
    ``pending``: a stop signal that came before this was called (``serve.early_stop``)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next(iter(infos))
    DrainingServer.address_family = family
    fingerprint = server_module.get_system_fingerprint()
    handler_class = handler or server_module.APIHandler
    if metrics is not None:
        metrics.generator = response_generator
    httpd = DrainingServer(
        address,
        lambda *a, **k: handler_class(response_generator, *a, system_fingerprint=fingerprint, **k),
        backlog,
        metrics=metrics,
        read_timeout=read_timeout,
        max_request_bytes=max_request_bytes,
        max_connections=max_connections,
    )
    stopping = threading.Event()

    def stop(why: str) -> None:
        stopping.set()
        log.info("persist: stopping (%s): no new requests; finishing %d", why, httpd.in_flight)
        # shutdown() waits for serve_forever, which runs in the main thread
        threading.Thread(target=httpd.shutdown, name="persist-stop", daemon=True).start()

    def on_signal(signum: int, _frame: Any) -> None:
        if stopping.is_set():
            log.warning("persist: second signal, stopping at once")
            os._exit(128 + signum)
        stop(signal.Signals(signum).name)

    died = threading.Event()

    def watch_generation() -> None:
        while not stopping.wait(0.5):
            if not response_generator.generation_available():
                died.set()
                stop("generation stopped; exiting non-zero so a supervisor restarts the server")
                return

    # Kept until the process exits: a second signal during the flush exits at once too.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    threading.Thread(target=watch_generation, name="persist-watch", daemon=True).start()
    early = pending()
    if early is not None:  # it came while the generation thread started: stop now
        stop(early)
    log.info("Starting httpd at %s on port %s (backlog %d)...", host, port, backlog)
    try:
        httpd.serve_forever()
    finally:
        stopping.set()
        httpd.socket.close()  # new connections are refused from here on
        t0 = time.monotonic()
        drained = threading.Event()
        httpd.stalls.watch(drained)  # the drain waits only for requests someone reads
        if not httpd.drain(drain_timeout):
            log.warning("persist: %d requests unfinished at the deadline", httpd.in_flight)
        drained.set()
        response_generator.stop_and_join()
        httpd.deadlines.close()
        log.info("persist: requests drained in %.2f s", time.monotonic() - t0)
    if died.is_set():
        why = getattr(response_generator, "death", None) or "the generation thread died"
        raise InvalidStateError(f"persist serve stopped because generation did: {why}")
