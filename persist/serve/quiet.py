"""Requests in their prompt phase, for the background work that gives way to them.

``RequestGate`` counts the requests between their arrival and their first
token (or their end): the time a client waits for while persist's prefill or
restore runs.  The write-behind holds its work at its ``persist.yielding.pause``
points while any request is there, and the host-tier keeper its next copy
(unless a lookup waits for it: ``serve.keeper``), at most ``hold`` seconds per
cache, so a server that is never idle still writes (late, not never).  Decode
steps do not hold them: a save's copies cost a token stream little, and a long
answer must not hold a save for its length.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["HOLD_SECONDS", "RequestGate"]

HOLD_SECONDS = 2.0  # the most one saved cache waits for requests, in all


class RequestGate:
    """The requests now in their prompt phase; waits of background work for them."""

    def __init__(self, hold: float = HOLD_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.hold, self.clock = hold, clock
        self._cond = threading.Condition()
        self._prompting = 0
        self.waited = 0.0  # seconds background work gave way, in all (/metrics)
        self.waiting = 0  # background threads waiting now

    def enter(self) -> Callable[[], None]:
        """A request arrived; the returned call (idempotent) says its prompt phase ended."""
        with self._cond:
            self._prompting += 1
        left = threading.Event()

        def leave() -> None:
            with self._cond:
                if left.is_set():
                    return
                left.set()
                self._prompting -= 1
                self._cond.notify_all()

        return leave

    @property
    def prompting(self) -> int:
        with self._cond:
            return self._prompting

    def pauses(self) -> Callable[[], None]:
        """The ``wait`` of one piece of background work (``yielding.giving_way``): it
        waits while a request is prompting, ``hold`` seconds at most over all its calls."""
        spent = [0.0]

        def wait() -> None:
            with self._cond:
                if not self._prompting or spent[0] >= self.hold:
                    return
                start = self.clock()
                self.waiting += 1
                self._cond.notify_all()
                try:
                    while self._prompting:
                        left = self.hold - spent[0] - (self.clock() - start)
                        if left <= 0:
                            break
                        self._cond.wait(left)
                finally:
                    took = self.clock() - start
                    spent[0] += took
                    self.waited += took
                    self.waiting -= 1

        return wait

    def wait_for_waiters(self, n: int, timeout: float) -> bool:
        """True once ``n`` background threads wait here (tests; bounded by ``timeout``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting >= n, timeout)
