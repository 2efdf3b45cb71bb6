"""The HTTP side of ``persist serve``: a backlog that fits bursts and a graceful drain.

mlx-lm's server listens with Python's default backlog of 5, so a burst of
simultaneous clients gets connection resets, and it stops on Ctrl-C by
tearing down the generation thread under requests still being answered.
This server (mlx-lm's handler, unchanged) listens with a configurable
backlog and stops in order on SIGTERM or SIGINT: stop accepting, let every
accepted request finish (up to a deadline), stop generation, return, so the
caller flushes the write-behind queue and exits 0.  A second signal exits at
once (what a killed writer leaves, ``persist check --fix`` removes).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

__all__ = ["DrainingServer", "serve_until_signal"]

log = logging.getLogger("persist")


class DrainingServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that counts requests in flight and can wait for them."""

    daemon_threads = True

    def __init__(self, address: Any, handler: Any, backlog: int) -> None:
        self.request_queue_size = backlog  # listen(backlog), read by server_activate
        self.in_flight = 0
        self._idle = threading.Condition()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
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
) -> None:
    """mlx-lm's ``_run_http_server`` with a real backlog and an orderly stop."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next(iter(infos))
    DrainingServer.address_family = family
    fingerprint = server_module.get_system_fingerprint()
    httpd = DrainingServer(
        address,
        lambda *a, **k: server_module.APIHandler(
            response_generator, *a, system_fingerprint=fingerprint, **k
        ),
        backlog,
    )
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stopping.is_set():
            log.warning("persist: second signal, stopping at once")
            os._exit(128 + signum)
        stopping.set()
        log.info("persist: stopping: no new requests; finishing %d", httpd.in_flight)
        # shutdown() waits for serve_forever, which runs in this (the main) thread
        threading.Thread(target=httpd.shutdown, name="persist-stop", daemon=True).start()

    # Kept until the process exits: a second signal during the flush exits at once too.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    log.info("Starting httpd at %s on port %s (backlog %d)...", host, port, backlog)
    try:
        httpd.serve_forever()
    finally:
        httpd.socket.close()  # new connections are refused from here on
        t0 = time.monotonic()
        if not httpd.drain(drain_timeout):
            log.warning("persist: %d requests unfinished at the deadline", httpd.in_flight)
        response_generator.stop_and_join()
        log.info("persist: requests drained in %.2f s", time.monotonic() - t0)
