"""The store's statistics writes of ``persist serve``, off the generation thread.

A lookup's counters, a restored row's last use, a hit's restore-or-recompute
decision and measured restore rate, and every prefill step's measured rate
were each a SQLite transaction (``synchronous=FULL``: an fsync)
on mlx-lm's generation thread, waiting behind the write-behind's commits for
the index lock: time every request paid before its first token, hit or miss
(issue 39).  Here the index holds counts, last uses, decisions and restore
rates in memory (``Index.hold_statistics``) and prefill rates wait in a queue; one thread
writes them every ``interval`` seconds and at ``flush``.  A crash loses
statistics of the last second, never data.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["StatsWriter"]

log = logging.getLogger("persist")

MAX_RATES = 1024  # prefill rates waiting at most; more are dropped (a busy disk)


class StatsWriter:
    """Writes ``store``'s held statistics and queued prefill rates from one thread.

    ``on_error`` hears a failed write (``ServeMetrics.store_failed``)."""

    def __init__(
        self,
        store: Any,
        *,
        interval: float = 1.0,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.store, self.interval, self.on_error = store, interval, on_error
        if not store.read_only:  # a read-only store keeps no statistics at all
            store.index.hold_statistics()
        self._lock = threading.Lock()
        self._rates: list[tuple[Any, int, int, float]] = []
        self.dropped = 0
        self._wake = threading.Event()
        self._stopping = False
        self._written = threading.Condition(self._lock)
        self._round = 0  # rounds written: flush waits for the next one
        self._thread = threading.Thread(target=self._run, name="persist-stats", daemon=True)
        self._thread.start()

    def prefilled(self, identity: Any, start: int, end: int, seconds: float) -> None:
        """A measured prefill for the store's cost model (``Store.record_prefill``)."""
        with self._lock:
            if len(self._rates) >= MAX_RATES:
                self.dropped += 1
                return
            self._rates.append((identity, start, end, seconds))

    def flush(self, timeout: float = 60.0) -> None:
        """Write what is waiting now, and wait until it is written."""
        if not self._thread.is_alive():  # closed: nothing can be waiting
            return
        with self._lock:
            target = self._round + 1
            self._wake.set()
            self._written.wait_for(lambda: self._round >= target, timeout)

    def close(self) -> None:
        self._stopping = True
        self.flush()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            with self._lock:
                rates, self._rates = self._rates, []
            for identity, start, end, seconds in rates:
                self._try(self.store.record_prefill, identity, start, end, seconds)
            self._try(self.store.index.write_statistics)
            with self._lock:
                self._round += 1
                self._written.notify_all()
            if self._stopping:
                return

    def _try(self, write: Callable[..., None], *args: Any) -> None:
        try:  # a full disk or a busy index never fails serving: counted, logged
            write(*args)
        except Exception as e:
            log.debug("persist: a statistics write failed: %s", e)
            if self.on_error is not None:
                self.on_error(e)
