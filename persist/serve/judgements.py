"""Lookups' verdicts, judged on the write-behind's thread before its next commit.

A verdict (``serve.explaining``) must read the store as its lookup saw it: a
save committed between the two made a miss look like a hit (attack 39h).  The
generation thread only hands a verdict over (``looking``: from before the
lookup reads the store until its verdict is handed over, the lookup is open);
the writer thread runs the verdicts handed over whenever it is between saves,
and, just before each of its commits (``yielding.at_commit``), waits for the
open lookups and runs theirs first; a lookup that would begin from then until
that commit ended waits for it (attack r14: one that began there read the
store without the save and was judged with it).  So a miss pays no index
reads on the generation thread (issue 39: about 7 ms a request on an H100
while a save was being written), and no save of this process lands between a
lookup and its verdict.  A lookup open longer than ``bound`` seconds (a
restore that hangs on a tier) no longer holds the save back: the save commits
and that lookup's verdict is dropped, never judged on a changed store; so is
one that waited ``bound`` seconds for a commit to end.  Commits this process
makes on another thread (a lookup's pull from a fleet tier) are not ordered
here; neither are other processes' saves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["BOUND_SECONDS", "Judgements"]

log = logging.getLogger("persist")
BOUND_SECONDS = 30.0  # the most a save waits for open lookups before it commits
Work = Callable[[], None]


class Judgements:
    """Verdicts handed over by lookups, run by the one thread that commits saves."""

    def __init__(self, bound: float = BOUND_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.bound, self.clock = bound, clock
        self._cond = threading.Condition()
        self._open = 0  # lookups between their start and their hand-over
        self._ready: list[Work] = []
        self._epoch = 0  # raised by a save that stopped waiting: open verdicts dropped
        self._wake_asked = False
        self.dropped = 0  # verdicts dropped so (tests, logs)
        self.holding = 0  # saves waiting for open lookups now (tests)
        self._committing = False  # between a save's before_commit and its after_commit

    @contextlib.contextmanager
    def looking(self) -> Iterator[Callable[[Work], None]]:
        """Around one lookup (generation thread): yields ``hand(work)``, which hands
        its verdict over (run later on the writer thread, before its next commit)."""
        with self._cond:
            deadline = self.clock() + self.bound
            while self._committing and (left := deadline - self.clock()) > 0:
                self._cond.wait(min(left, 1.0))  # a commit takes milliseconds
            self._open += 1
            # a commit that will not end: judged after it, this verdict is dropped
            epoch = self._epoch - 1 if self._committing else self._epoch
        handed: list[Work] = []
        try:
            yield handed.append
        finally:
            with self._cond:
                self._open -= 1
                if epoch == self._epoch:
                    self._ready.extend(handed)
                else:
                    self.dropped += len(handed)
                self._cond.notify_all()

    def wake(self) -> bool:
        """True once per run of ready verdicts: the caller then asks the writer to run
        them (a thread with nothing to write waits for work of its own)."""
        with self._cond:
            if not self._ready or self._wake_asked:
                return False
            self._wake_asked = True
            return True

    def run_ready(self) -> None:
        """Writer thread, between saves: run the verdicts handed over so far."""
        with self._cond:
            self._wake_asked = False
            work, self._ready = self._ready, []
        for w in work:
            w()

    def after_commit(self) -> None:
        """Writer thread, once a commit ended: lookups may begin again."""
        with self._cond:
            self._committing = False
            self._cond.notify_all()

    def before_commit(self) -> None:
        """Writer thread, just before a commit: wait for the open lookups (``bound``
        seconds at most) and run every verdict handed over, theirs included; no
        lookup begins until ``after_commit``."""
        deadline = self.clock() + self.bound
        while True:
            self.run_ready()
            with self._cond:
                if self._ready:
                    continue
                if not self._open:
                    self._committing = True
                    return
                left = deadline - self.clock()
                if left <= 0:
                    self._epoch += 1  # their verdicts would read this commit: dropped
                    self._committing = True
                    log.warning(
                        "persist: a save stopped waiting for %d lookup(s) after %.0f s; "
                        "their verdicts are not counted", self._open, self.bound,
                    )  # fmt: skip
                    return
                self.holding += 1
                self._cond.notify_all()
                try:
                    self._cond.wait(min(left, 1.0))
                finally:
                    self.holding -= 1

    def wait_for_holding(self, n: int, timeout: float) -> bool:
        """True once ``n`` saves wait for open lookups (tests; bounded by ``timeout``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.holding >= n, timeout)
