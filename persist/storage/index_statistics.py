"""An index's statistics: counters by namespace, snapshots' last uses, held in memory
until their owner writes them where a caller asks for that.

A counter update or a row's last-use time is one SQLite transaction
(``synchronous=FULL``: an fsync), taken on whatever thread asked: in ``persist
serve`` that is mlx-lm's generation thread, before a request's first token,
waiting behind the write-behind's commits for the lock (issue 39).  An index
told to hold them (``Index.hold_statistics``) sums them here instead, and holds
the other statistics rows (measured rates, decisions: ``storage.rates``); its
owner writes them in one transaction now and then (``Index.write_statistics``:
serve.stats_writer).  What a crash loses is a count or a last-use time: a
statistic and an eviction order, never data.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["HeldStatistics", "IndexStatistics"]


MAX_DEFERRED = 4096  # statistics rows held at most; past it each is written at once


class HeldStatistics:
    """Counter deltas by namespace, last-use times by snapshot and other statistics
    rows (``defer``: measured rates, decisions), not yet written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, Counter[str]] = {}
        self.used: dict[int, float] = {}
        self.rows: list[Callable[[Any], None]] = []

    def defer(self, write: Callable[[Any], None]) -> bool:
        """Hold ``write(db)`` for the next ``write_statistics`` (False: too many held)."""
        with self._lock:
            if len(self.rows) >= MAX_DEFERRED:
                return False
            self.rows.append(write)
            return True

    def count(self, namespace: str, deltas: dict[str, int]) -> None:
        with self._lock:
            self.counts.setdefault(namespace, Counter()).update(deltas)

    def touch(self, snapshot_id: int, when: float) -> None:
        with self._lock:
            self.used[snapshot_id] = when

    def take(
        self,
    ) -> tuple[dict[str, Counter[str]], dict[int, float], list[Callable[[Any], None]]]:
        """Everything held, handed over (and held no more)."""
        with self._lock:
            counts, used, rows = self.counts, self.used, self.rows
            self.counts, self.used, self.rows = {}, {}, []
        return counts, used, rows

    def give_back(
        self,
        counts: dict[str, Counter[str]],
        used: dict[int, float],
        rows: list[Callable[[Any], None]],
    ) -> None:
        """What a failed write took: held again, for the next try."""
        with self._lock:
            self.rows[:0] = rows[: max(0, MAX_DEFERRED - len(self.rows))]
            for ns, deltas in counts.items():
                self.counts.setdefault(ns, Counter()).update(deltas)
            for sid, when in used.items():
                self.used[sid] = max(when, self.used.get(sid, when))

    def pending(self, namespace: str | None) -> Counter[str]:
        """The deltas held for ``namespace`` (all of them for None)."""
        out: Counter[str] = Counter()
        with self._lock:
            for ns, deltas in self.counts.items():
                if namespace is None or ns == namespace:
                    out.update(deltas)
        return out


class IndexStatistics:
    """The counters and last-use methods of ``storage.index.Index`` (its base)."""

    held: HeldStatistics | None

    if TYPE_CHECKING:  # Index's transaction and consistent view

        def write(self) -> contextlib.AbstractContextManager[Any]: ...
        def read(self) -> contextlib.AbstractContextManager[Any]: ...

    def touch(self, snapshot_id: int) -> None:
        if self.held is not None:
            self.held.touch(snapshot_id, time.time())
            return
        with self.write() as db:
            db.execute("UPDATE snapshots SET used = ? WHERE id = ?", [time.time(), snapshot_id])

    def hold_statistics(self) -> None:
        """From now on counts and last uses wait in memory for ``write_statistics``."""
        if self.held is None:  # a second holder shares what the first held
            self.held = HeldStatistics()

    def write_statistics(self) -> None:
        """Write the held counts and last uses, in one transaction."""
        if self.held is None:
            return
        counts, used, rows = self.held.take()
        if not counts and not used and not rows:
            return
        try:
            with self.write() as db:
                for namespace, deltas in counts.items():
                    _add_counts(db, namespace, deltas)
                for sid, when in used.items():  # a row deleted since: nothing updated
                    db.execute("UPDATE snapshots SET used = MAX(used, ?) WHERE id = ?", [when, sid])
                for write in rows:
                    write(db)
        except BaseException:
            self.held.give_back(counts, used, rows)
            raise

    def count(self, namespace: str, **deltas: int) -> None:
        if self.held is not None:
            self.held.count(namespace, deltas)
            return
        with self.write() as db:
            _add_counts(db, namespace, deltas)

    def counters(self, namespace: str | None = None) -> dict[str, int]:
        sql, args = "SELECT name, SUM(value) FROM counters", []
        if namespace is not None:
            sql += " WHERE namespace = ?"
            args.append(namespace)
        with self.read() as db:
            got = {r[0]: int(r[1]) for r in db.execute(sql + " GROUP BY name", args)}
        if self.held is not None:  # this process's counts not yet written
            for name, d in self.held.pending(namespace).items():
                got[name] = got.get(name, 0) + d
        return got


def _add_counts(db: Any, namespace: str, deltas: Any) -> None:
    for name, d in deltas.items():
        db.execute(
            "INSERT INTO counters(namespace, name, value) VALUES (?, ?, ?) "
            "ON CONFLICT(namespace, name) DO UPDATE SET value = value + excluded.value",
            [namespace, name, d],
        )
