"""``persist.Store``: named sessions and cross-session prefix reuse.

The service layer over the storage layer (``persist.store``, no mlx):
it turns live caches into token blocks plus a tail blob, commits them to
the index, and reads them back straight into fresh cache buffers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from .errors import (
    CorruptBlobError,
    IdentityMismatchError,
    NotResumableError,
    SessionNotFoundError,
)
from .identity import ModelIdentity
from .manifest import check_metadata
from .records import Progress
from .store import lookup as lookup_queries
from .store import retention
from .store.blobs import FileBlobs
from .store.chains import (
    chain_root,
    chains,
    check_tokens,
    unpack_tokens,
)
from .store.index import Index, SnapshotRow
from .store.rows import check_name, entry_info, store_root
from .store.schema import connect
from .store.types import EntryInfo, GcReport, Problem, Restored, Rollback, StoreStats

if TYPE_CHECKING:  # the save path imports mlx: loaded by the first save, not by ``ls``
    from .saving import Target
    from .snapshot import Snapshot

__all__ = ["Store", "check_name"]

log = logging.getLogger("persist")
DEFAULT_BLOCK = 256
RESTORE_RETRIES = 4  # re-reads of a session that concurrent saves keep replacing


class Store:
    """A directory of cached states: ``Store(root, max_bytes=None, block_tokens=256)``.

    ``namespace_max_bytes`` (bytes for every namespace, or a map of namespace
    to bytes) gives tenants budgets of their own: then a save evicts only
    entries of its own namespace, so one tenant's saves never evict another's
    sessions, and a save that cannot fit in its namespace is StoreFullError.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        block_tokens: int | None = None,
        namespace_max_bytes: int | Mapping[str, int] | None = None,
    ) -> None:
        self.root = store_root(root)
        if not self.root.exists():
            self.root.mkdir(mode=0o700, parents=True)
        if block_tokens is not None and not 1 <= block_tokens <= 1 << 20:
            raise ValueError("block_tokens must be between 1 and 1048576")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        budgets = namespace_max_bytes
        if budgets is not None and any(
            type(b) is not int or b < 0
            for b in (budgets.values() if isinstance(budgets, Mapping) else [budgets])
        ):
            raise ValueError("namespace_max_bytes must be bytes >= 0 (or a map of them)")
        self.namespace_max_bytes = budgets
        self.blobs = FileBlobs(self.root)
        db = connect(
            self.root / "index.sqlite", block_tokens or DEFAULT_BLOCK, adopt=block_tokens is None
        )
        for suffix in ("", "-wal", "-shm"):
            p = self.root / f"index.sqlite{suffix}"
            if p.exists() and not p.is_symlink():
                os.chmod(p, 0o600)
        self.index = Index(db)
        self.block_tokens = int(
            db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()[0]
        )

    # -- context manager --------------------------------------------------

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.index.db.conn.close()

    # -- saving -----------------------------------------------------------

    def save(
        self,
        cache: Sequence[Any] | Snapshot,
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        session: str | None = None,
        namespace: str = "default",
        pin: bool = False,
        metadata: Mapping[str, str] | None = None,
        progress: Progress | None = None,
    ) -> EntryInfo:
        """Save ``cache`` (covering exactly ``tokens``); named if ``session`` is given.

        ``cache`` may also be a ``persist.snapshot.capture(cache, tokens)`` taken
        earlier, in another thread (a server captures on its generation thread).
        """
        from .saving import Target

        role = "prefix" if session is None else "session"
        target = Target(identity, namespace, session, None, role, pin, check_metadata(metadata))
        return self._save(cache, tokens, target, progress)

    def _save(
        self,
        cache: Sequence[Any] | Snapshot,
        tokens: Sequence[int],
        target: Target,
        progress: Progress | None = None,
    ) -> EntryInfo:
        check_name(target.namespace, "namespace")
        if target.name is not None:
            check_name(target.name, "session")
        from .saving import save_snapshot

        return self._info(save_snapshot(self, cache, tokens, target, progress))

    def _collect(self) -> int:
        """Unlink blob files whose last reference was committed away."""
        dead = self.index.collect()
        for f in dead:
            self.blobs.delete(f)
        self.index.forget(dead)
        return len(dead)

    # -- reading ----------------------------------------------------------

    def restore(
        self,
        session: str,
        *,
        identity: ModelIdentity,
        namespace: str = "default",
        progress: Progress | None = None,
    ) -> Restored:
        """The named session, as fresh caches, exactly as saved.

        The row and its blocks are read in one transaction.  If a blob of it is
        gone because the session was saved again meanwhile (its old blobs
        collected), the new version is restored instead; a blob missing from
        a row that did not change is damage (CorruptBlobError).
        """
        from .assemble import load_snapshot

        check_name(namespace, "namespace")
        check_name(session, "session")
        last_id = None
        for _attempt in range(RESTORE_RETRIES):
            found = self.index.by_name_with_blocks(namespace, session)
            if found is None:
                raise SessionNotFoundError(session, namespace)
            row, refs = found
            if row.identity != identity.digest:
                saved = ModelIdentity.from_dict(msgpack.unpackb(row.identity_map, raw=False))
                raise IdentityMismatchError(f"session {session!r}", saved.diff(identity))
            try:
                cache = load_snapshot(self, row, progress, refs=refs)
                break
            except CorruptBlobError:
                # damage, unless a newer save replaced the row meanwhile
                if row.id == last_id or self.index.get(row.id) is not None:
                    raise
                last_id = row.id
        else:
            raise CorruptBlobError(f"session {session!r}", "kept changing while it was read")
        self.index.touch(row.id)
        self.index.count(namespace, restores=1, restored_tokens=row.n_tokens)
        return Restored(cache, unpack_tokens(row.tokens), self._info(row))

    def namespace_budget(self, namespace: str) -> int | None:
        """The byte budget of ``namespace`` (None: only the store's ``max_bytes``)."""
        b = self.namespace_max_bytes
        return b.get(namespace) if isinstance(b, Mapping) else b

    def lookup(
        self,
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        namespace: str = "default",
        longer_than: int = 0,
    ) -> Restored | None:
        """The longest usable stored prefix of ``tokens`` (at least one token is left over).

        Token-exact: a hit of k tokens holds exactly what a fresh prefill of
        those k tokens would (the codecs cut every layer to k).  A hit of at
        most ``longer_than`` tokens (what a caller already holds in memory)
        is not read at all and returns None, uncounted.
        """
        from .assemble import load_snapshot

        toks = check_tokens(tokens)
        skip: set[int] = set()
        while True:
            found = self._choose(toks, identity, namespace, skip)
            if found is None:
                break
            row, prefix = found
            if prefix <= longer_than:
                return None
            try:
                cache = load_snapshot(self, row, keep=prefix)
            except CorruptBlobError as e:
                log.warning("persist: skipping a damaged snapshot in lookup: %s", e)
                self.index.count(namespace, corrupt_skipped=1)
                skip.add(row.id)
                continue
            self.index.touch(row.id)
            self.index.count(namespace, hits=1, restored_tokens=prefix)
            return Restored(cache, toks[:prefix], self._info(row))
        self.index.count(namespace, misses=1)
        return None

    def _choose(
        self, toks: list[int], identity: ModelIdentity, namespace: str, skip: set[int]
    ) -> tuple[SnapshotRow, int] | None:
        """The row and usable prefix a lookup restores, from the index alone (no blob read)."""
        check_name(namespace, "namespace")
        secret = self.index.secret(namespace)  # a lookup never creates a namespace
        if secret is None:
            return None
        chs = chains(chain_root(secret, identity.digest), toks, self.block_tokens)
        return lookup_queries.choose(
            self.index, namespace, identity.digest, chs, toks, self.block_tokens, skip
        )

    def find(
        self, tokens: Sequence[int], *, identity: ModelIdentity, namespace: str = "default"
    ) -> tuple[EntryInfo, int] | None:
        """What ``lookup`` would restore (entry, usable prefix), from the index alone."""
        found = self._choose(check_tokens(tokens), identity, namespace, set())
        return None if found is None else (self._info(found[0]), found[1])

    # -- listing and maintenance --------------------------------------------

    def sessions(self, namespace: str | None = None) -> list[EntryInfo]:
        return [self._info(r) for r in self.index.snapshots(namespace, named_only=True)]

    def entries(self, namespace: str | None = None) -> list[EntryInfo]:
        """Every snapshot: sessions, checkpoints and anonymous prefixes."""
        return [self._info(r) for r in self.index.snapshots(namespace, named_only=False)]

    def entry(self, session: str, *, namespace: str = "default") -> EntryInfo:
        row = self.index.by_name(namespace, session)
        if row is None:
            raise SessionNotFoundError(session, namespace)
        return self._info(row)

    def export(
        self, session: str, path: str | os.PathLike[str], *, namespace: str = "default"
    ) -> EntryInfo:
        """Write a session to one self-contained persist file (``load_file`` reads it)."""
        from .assemble import load_snapshot
        from .files import save_file

        row = self.index.by_name(check_name(namespace, "namespace"), check_name(session, "session"))
        if row is None:
            raise SessionNotFoundError(session, namespace)
        saved = ModelIdentity.from_dict(msgpack.unpackb(row.identity_map, raw=False))
        info = self._info(row)
        save_file(
            path,
            load_snapshot(self, row),
            unpack_tokens(row.tokens),
            metadata=info.metadata,
            identity=saved,
        )
        return info

    def import_file(
        self,
        path: str | os.PathLike[str],
        *,
        session: str | None = None,
        namespace: str = "default",
    ) -> EntryInfo:
        """Store a persist file as a session (named after the file unless ``session``)."""
        from .files import load_file

        loaded = load_file(path)
        if loaded.identity is None or loaded.tokens is None:
            raise NotResumableError(
                f"{path} records no model identity or no tokens; save it with "
                "persist.save_file(path, cache, tokens, identity=...) to import it"
            )
        name = session if session is not None else Path(path).name.split(".")[0]
        return self.save(
            loaded.cache,
            loaded.tokens,
            identity=loaded.identity,
            session=name,
            namespace=namespace,
            metadata=loaded.metadata,
        )

    def has_session(self, session: str, *, namespace: str = "default") -> bool:
        return (
            self.index.by_name(check_name(namespace, "namespace"), check_name(session, "session"))
            is not None
        )

    def pin(self, session: str, *, namespace: str = "default", pinned: bool = True) -> None:
        """Pin (or unpin) a session and its checkpoints: pinned entries are never evicted."""
        check_name(session, "session")
        with self.index.write() as db:
            changed = Index.set_pinned(db, namespace, session, pinned)
        if not changed:
            raise SessionNotFoundError(session, namespace)

    def delete(self, session: str, *, namespace: str = "default") -> None:
        """Delete a session and its checkpoints; files go after the commit."""
        check_name(session, "session")
        with self.index.write() as db:
            rows = Index.rows_where(
                db,
                "namespace = ? AND (name = ? OR (name IS NULL AND owner = ?))",
                [namespace, session, session],
            )
            if not any(r.name == session for r in rows):
                raise SessionNotFoundError(session, namespace)
            for r in rows:
                Index.remove(db, r.id)
        self._collect()

    def gc(self, max_bytes: int | None = None, *, dry_run: bool = False) -> GcReport:
        """Evict least recently used unpinned snapshots down to ``max_bytes``.

        Without a budget (here or on the store) it only deletes unreferenced
        blob files.  ``dry_run`` reports what would go and changes nothing.
        """
        budget = self.max_bytes if max_bytes is None else max_bytes
        before = self.index.unique_bytes()
        victims: list[EntryInfo] = []
        try:
            with self.index.write() as db:
                if budget is not None:  # the same rule a save applies
                    rows, _ = retention.evict_lru(db, self.index, [(budget, None)], None)
                    victims = [self._info(r) for r in rows]
                if dry_run:
                    after = self.index.unique_bytes(db)
                    raise Rollback(GcReport(victims, 0, before - after, after, True))
        except Rollback as r:
            return r.report
        deleted = self._collect()
        after = self.index.unique_bytes()
        return GcReport(victims, deleted, before - after, after, False)

    def stats(self, namespace: str | None = None) -> StoreStats:
        rows = self.index.snapshots(namespace, named_only=False)
        return StoreStats(
            entries=len(rows),
            sessions=sum(1 for r in rows if r.name is not None),
            unique_bytes=self.index.unique_bytes(namespace=namespace),
            referenced_bytes=sum(r.nbytes for r in rows),
            counters=self.index.counters(namespace),
        )

    def check(self, fix: bool = False, *, progress: Progress | None = None) -> list[Problem]:
        """Reconcile index and files; with ``fix`` repair what can be repaired."""
        from .store.check import check_store

        return check_store(self.index, self.blobs, fix, progress)

    # -- helpers ------------------------------------------------------------

    def _info(self, r: SnapshotRow) -> EntryInfo:
        return entry_info(r)
