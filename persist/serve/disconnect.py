"""A request nobody will read is not generated: the client's closed socket stops it.

mlx-lm generates a non-streaming answer to its end before it writes a byte,
so a client that hung up is noticed only at that write: a request with a
huge ``max_tokens`` kept a core busy for minutes, and the drain on SIGTERM
waited for it.  The handler thread watches its connection while it waits
for generation (``watching``): a socket that the client closed (EOF or an
error on a peek, as nginx treats a client abort) raises ``ClientGone`` in
that thread, and the request's queue is marked abandoned
(``AbandonableQueue``): its generation context is stopped, now or as soon
as the generation thread hands it over, so mlx-lm's loop drops the request
at its next token.  A client that half-closes its side after sending is
treated as gone too.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable, Iterator
from queue import Queue
from typing import Any

from ..errors import PersistError

__all__ = ["AbandonableQueue", "ClientGone", "client_gone", "closed", "watching"]

_watched = threading.local()  # the socket this handler thread answers, while it waits


class ClientGone(PersistError, ConnectionError):
    """The client closed its connection before its answer was ready."""


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock``: its side shut (Linux's POLLRDHUP, seen even
    behind unread bytes), readable with nothing to read (EOF), or an error.  Bytes
    waiting (a pipelined request) are left where they are."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if rdhup:  # a peek sees only the first waiting byte: pipelined bytes hid the EOF
        try:
            poller = select.poll()
            poller.register(sock, select.POLLIN | rdhup)
            events = poller.poll(0)
        except (OSError, ValueError):
            return True
        gone = rdhup | select.POLLHUP | select.POLLERR | select.POLLNVAL
        return any(e & gone for _, e in events)
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        if not ready:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset by the peer, or already closed here
        return True


@contextlib.contextmanager
def watching(sock: socket.socket) -> Iterator[None]:
    """While inside, ``client_gone()`` in this thread asks whether ``sock``'s peer left."""
    _watched.sock = sock
    try:
        yield
    finally:
        _watched.sock = None


def client_gone() -> bool:
    """Whether this thread's watched client closed its connection (False: none watched)."""
    sock = getattr(_watched, "sock", None)
    return sock is not None and closed(sock)


class AbandonableQueue(Queue[Any]):
    """A request's response queue that can be abandoned by its handler.

    The generation thread puts the request's ``GenerationContext`` first;
    abandoning stops that context (``ctx.stop()``), whether it is already here
    or arrives later, and counts what is put afterwards (tokens generated for
    nobody: ``wasted``)."""

    def __init__(self, on_waste: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.abandoned = False
        self.context: Any = None
        self.wasted = 0
        self.on_waste = on_waste

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        with self._lock:
            if self.context is None and hasattr(item, "stop") and hasattr(item, "prompt"):
                self.context = item
                if self.abandoned:
                    item.stop()
            elif self.abandoned and hasattr(item, "token"):
                self.wasted += 1
                if self.on_waste is not None:
                    self.on_waste()
        super().put(item, block, timeout)

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            if self.context is not None:
                self.context.stop()
