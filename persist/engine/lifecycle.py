"""The Store's lifecycle and upkeep: closing, pins, deletes, gc, stats, check, sync.

``persist.Store`` (engine/store.py) derives from ``StoreUpkeep`` and sets the
attributes below in its ``__init__``; what lives here never imports mlx (a
cut session in ``check --fix`` loads it through ``salvage``, only then).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    InvalidArgumentError,
    InvalidStateError,
    ReadOnlyStoreError,
    SessionDeletedError,
    SessionNotFoundError,
)
from ..policy import stronger_hints
from ..records import Progress
from ..storage import full, housekeeping, rates, retention, writes
from ..storage.check_damage import clear_quarantine
from ..storage.rows import check_name, check_namespace
from ..storage.types import GcReport, Problem, StoreStats

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..storage.blobs import FileBlobs
    from ..storage.index import Index
    from .host.tier import HostTier
    from .tiers.exchange import Shared

# the hint rules the engine's callers use (persist serve may not import policy)
__all__ = ["StoreUpkeep", "check_hints", "parse_ttl", "stronger_hints"]


class StoreUpkeep:
    """Closing and maintenance of a store; ``persist.Store`` adds the data path."""

    root: Path
    blobs: FileBlobs
    budgets: retention.Budgets
    block_tokens: int
    tiers: list[Shared]
    _index: Index | None
    host: HostTier | None = None  # Store(host_cache=...): engine.host_store
    read_only: bool = False  # opened read-only (storage/access.read_only): writes refused

    # -- context manager --------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the index and drop the host tier's copies; any later call on this
        Store is InvalidStateError."""
        if self.host is not None:
            self.host.clear(close=True)
            self.host = None
        if self._index is not None:
            with contextlib.suppress(Exception):  # statistics: never a failure to close
                full.best_effort(self._index.write_statistics)
            self._index.db.conn.close()
            self._index = None

    @property
    def index(self) -> Index:
        """The SQLite index (``persist.storage.index``); InvalidStateError once closed."""
        if self._index is None:
            raise InvalidStateError(f"the store at {self.root} is closed")
        return self._index

    def keeps_unpushed(self) -> bool:
        """Does budget eviction keep named sessions no tier holds yet (their only copy)?
        With tiers configured, or in a store that ever pushed to or pulled from one (a
        fleet machine's ``persist gc`` run without the tier settings): until a push
        or ``persist sync`` puts them on a tier (``retention.UNPUSHED``)."""
        return bool(self.tiers) or self.index.has_tier_history()

    def has_session(self, session: str, *, namespace: str = "default") -> bool:
        return self.index.by_name(namespace, session) is not None  # names checked there

    def pin(self, session: str, *, namespace: str = "default", pinned: bool = True) -> None:
        """Pin (or unpin) a session and its checkpoints: pinned entries are never evicted."""
        check_name(session, "session")
        check_name(namespace, "namespace")
        with self.index.write() as db:
            changed = writes.set_pinned(db, namespace, session, pinned)
        if not changed:
            raise SessionNotFoundError(session, namespace)

    def retain(
        self,
        session: str,
        *,
        ttl: float | None = None,
        priority: int | None = None,
        namespace: str = "default",
    ) -> None:
        """Retention hints for a session and its checkpoints (``Store.save``'s ``ttl``
        and ``priority``); both None or 0 clear them.  They order eviction within the
        budget, never exceed it: ``pin`` is the only way to keep an entry for good."""
        check_name(session, "session")
        check_name(namespace, "namespace")
        ttl_s, prio = check_hints(ttl, priority) or (0.0, 0)
        with self.index.write() as db:
            changed = writes.set_session_hints(db, namespace, session, ttl_s, prio)
        if not changed:
            raise SessionNotFoundError(session, namespace)

    def retention(
        self, session: str, *, namespace: str = "default"
    ) -> tuple[bool, tuple[float, int] | None]:
        """(pinned, (ttl, priority) or None) of a session; SessionNotFoundError if none."""
        check_name(session, "session")
        check_name(namespace, "namespace")
        with self.index.read() as db:
            if (
                db.execute(
                    "SELECT 1 FROM snapshots WHERE namespace = ? AND name = ?", [namespace, session]
                ).fetchone()
                is None
            ):
                raise SessionNotFoundError(session, namespace)
            return writes.session_pinned(db, namespace, session), writes.session_hints(
                db, namespace, session
            )

    def delete(self, session: str, *, namespace: str = "default", fleet: bool = False) -> list[str]:
        """Delete a session and its checkpoints (also those an interrupted prime left
        without a session: the name owns them); files go after the commit.  Here only:
        the tiers keep theirs, and a new history saved here under the name is pushed
        beside it (``NAME~N``).  ``fleet``: first the tiers' session of the name too
        (a tombstone: ``engine/tiers/fleet_delete``; TierUnavailable, nothing deleted,
        when a tier cannot be asked); the names of the tiers that held it.
        SessionDeletedError (a SessionNotFoundError) where a fleet delete found only
        tombstones: deleted already."""
        check_name(session, "session")
        check_name(namespace, "namespace")
        held: list[str] = []
        gone: list[str] = []  # tiers with a fleet delete's tombstone there already
        if fleet:
            if self.read_only:
                raise ReadOnlyStoreError(self.root)
            if not self.tiers:
                raise InvalidArgumentError("a fleet delete needs a shared or cold tier")
            from .tiers.fleet_delete import delete_everywhere

            held, gone = delete_everywhere(self.tiers, self.index, namespace, session)

        def remove() -> None:
            with self.index.write() as db:
                rows = writes.session_rows(db, namespace, session)
                if not rows and not held:
                    if gone:  # deleted already, nothing anywhere: a re-run (attack 38d, F)
                        raise SessionDeletedError(session, namespace, gone)
                    raise SessionNotFoundError(session, namespace)
                for r in rows:
                    writes.remove(db, r.id)
                if not fleet:  # the fleet's history stays; what is saved here next is new
                    writes.forget_base(db, namespace, session)

        full.with_room(self.root, remove)  # works on a full disk: the reserve makes room
        full.with_room(self.root, lambda: retention.collect(self.index, self.blobs))
        full.best_effort(housekeeping.truncate_wal, self.index)  # its room before the reserve's
        full.ensure_reserve(self.root)
        return held

    def gc(self, max_bytes: int | None = None, *, dry_run: bool = False) -> GcReport:
        """Evict least recently used unpinned snapshots down to ``max_bytes``.

        Without a budget (here or on the store) it only deletes unreferenced
        blob files.  ``dry_run`` reports what would go and changes nothing.  With
        tiers (``keeps_unpushed``), a named session whose latest version no tier holds
        yet (a push held back or failed: its only copy) is kept, counted in
        ``unpushed_kept``.
        """
        budget = self.budgets.max_bytes if max_bytes is None else max_bytes
        keep = self.keeps_unpushed()  # named sessions no tier holds yet: their only copy
        report = full.with_room(
            self.root, lambda: retention.gc(self.index, self.blobs, budget, dry_run, keep)
        )
        if report.evicted and not dry_run:  # a large delete: its log goes back to nothing
            full.best_effort(housekeeping.truncate_wal, self.index)
        full.ensure_reserve(self.root)  # only once there is room for it
        cleared = clear_quarantine(self.root, dry_run=dry_run)
        return dataclasses.replace(report, quarantine_cleared=cleared)

    def stats(self, namespace: str | None = None) -> StoreStats:
        # Counted over an index, not read row by row (4.4 s at 100,000 sessions): an
        # aggregate, not counts kept by triggers, so there is nothing to drift or repair.
        entries, sessions, referenced = self.index.tally(check_namespace(namespace))
        return StoreStats(
            entries=entries,
            sessions=sessions,
            unique_bytes=self.index.unique_bytes(namespace=namespace),
            referenced_bytes=referenced,
            counters=self.index.counters(namespace),
            rates=rates.all_rates(self.index),
            decisions=rates.decisions(self.index, namespace),
            data_paths=rates.paths(self.index),
            host_cache=self.host.stats() if self.host is not None else None,
        )

    def check(self, fix: bool = False, *, progress: Progress | None = None) -> list[Problem]:
        """Reconcile index and files; with ``fix`` repair what can be repaired (a
        read-only store: ReadOnlyStoreError before anything is looked at)."""
        from ..storage.check import check_store
        from .salvage import cutter

        if fix and self.read_only:  # never a repair that dies half-way of EROFS
            raise ReadOnlyStoreError(self.root)

        cut = cutter(self.index, self.blobs, self.block_tokens, self.budgets)
        return check_store(self.index, self.blobs, fix, progress, cut)

    def tidy(self) -> list[Problem]:
        """Remove what killed writers left (``storage.check.tidy``); saves in flight stay."""
        from ..storage.check import tidy

        if self.read_only:
            return []  # nothing to remove with, and no writer of its own left anything
        return full.with_room(self.root, lambda: tidy(self.index, self.blobs))

    def sync(
        self, *, namespace: str | None = None, pull: Sequence[str] = (), rekey: bool = False
    ) -> dict[str, Any]:
        """Push what the tiers lack (every snapshot), pull the named sessions ``pull``.
        ``rekey``: this store's operator key is the fleet's (a rotation): a session
        pointer under another key, or none, is replaced, not a conflict."""
        from .tiers.exchange import sync

        names = [check_name(n, "session") for n in pull]  # as every other command's
        for tier in self.tiers:
            tier.rekey = rekey
        try:
            return sync(self.index, self.blobs, self.tiers, namespace, names)
        finally:
            for tier in self.tiers:
                tier.rekey = False


MAX_PRIORITY = 1000  # |priority|: an order, not a quantity; bounded so it is plain data


def check_hints(ttl: float | None, priority: int | None) -> tuple[float, int] | None:
    """(ttl seconds, priority), checked; None when neither is given."""
    if ttl is None and priority is None:
        return None
    t = 0.0 if ttl is None else ttl
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
        raise InvalidArgumentError(f"ttl is seconds, at least 0 and finite: not {ttl!r}")
    p = 0 if priority is None else priority
    if type(p) is not int or abs(p) > MAX_PRIORITY:
        raise InvalidArgumentError(
            f"priority is a whole number from -{MAX_PRIORITY} to {MAX_PRIORITY}: not {priority!r}"
        )
    return float(t), p


MAX_TTL = 30 * 86400.0  # a month: longer is what pin is for
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_ttl(text: str) -> float:
    """Seconds of a ttl as clients write it: ``"5m"``, ``"1h"``, ``"30s"``, ``"2d"``
    (Anthropic's cache_control ttl takes "5m" and "1h") or plain seconds."""
    t = text.strip().lower() if isinstance(text, str) else ""
    unit = _UNITS.get(t[-1:]) if t else None
    number = t[:-1] if unit is not None else t
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_TTL or len(t) > 32:
        raise InvalidArgumentError(
            f"a ttl is seconds or a number with s, m, h or d, at most 30 days: not {text!r}"
        )
    return value
