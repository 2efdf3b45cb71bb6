"""Copying what mlx-lm evicts into the host tier, off mlx-lm's generation thread.

mlx-lm evicts inside its prompt cache's insert, and its server inserts at the
end of every prompt segment: in the middle of a request's prompt processing.
On a GPU, keeping an evicted 1 GiB cache in pinned host pages (growing the
pinned pool, then a device-to-host copy) took 0.43 s per cache on an H100 (the
e2e benchmark's ``/metrics``, step ``keep``), all of it added to that request's
time to first token.  Here the generation thread only evaluates the evicted
cache (``handoff.handed_off``, as for an insert: a batch's lazy slice is
computed on the stream it was made on) and hands it over; one thread of its own
copies it, on a stream of its own
(``handoff.writer_stream``).  Safe for the reason the write-behind is: an
evaluated MLX array never changes, and mlx-lm no longer holds an evicted cache.

A lookup first waits for the hand-overs in flight (``settle``): the host tier
answers as if the keep had been made in place, and the wait is rarely more than
nothing, since a keep runs while the rest of its request is processed.  At most
``size`` evicted caches wait (their device memory is what eviction meant to
free); one more is not kept (``dropped``; the write-behind's store copy still
serves it).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.host.tier import HostTier
from .handoff import writer_stream

__all__ = ["EvictionKeeper"]

log = logging.getLogger("persist")

Kept = tuple[str, list[int], list[Any], "tuple[float, int] | None"]


class EvictionKeeper:
    """One thread that keeps evicted caches in ``host``; ``on_error`` hears its failures."""

    def __init__(
        self,
        host: HostTier,
        *,
        size: int = 2,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.host, self.on_error = host, on_error
        self.dropped = 0
        self._queue: queue.Queue[Kept | None] = queue.Queue(size)
        self._thread = threading.Thread(target=self._run, name="persist-keeper", daemon=True)
        self._thread.start()

    def offer(
        self,
        owner: str,
        tokens: Sequence[int],
        cache: Sequence[Any],
        hints: tuple[float, int] | None = None,
    ) -> bool:
        """Hand an evicted cache over; False (counted in ``dropped``) when ``size``
        caches already wait.  Never blocks the caller."""
        try:
            self._queue.put_nowait((owner, list(tokens), list(cache), hints))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def settle(self) -> None:
        """Wait until every cache handed over is kept (or refused)."""
        self._queue.join()

    def close(self) -> None:
        self.settle()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                owner, tokens, cache, hints = item
                del item
                with writer_stream():
                    self.host.keep(owner, tokens, cache, hints=hints)
                del cache  # its device memory goes back as soon as the copy is made
            except Exception as e:  # the tier must never take the server down
                log.warning("persist: could not keep an evicted cache in the host cache: %s", e)
                if self.on_error is not None:
                    self.on_error(e)
            finally:
                self._queue.task_done()
