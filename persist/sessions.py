"""``persist.Store``: named sessions and cross-session prefix reuse.

The service layer over the storage layer (``persist.store``, no mlx):
it turns live caches into token blocks plus a tail blob, commits them to
the index, and reads them back straight into fresh cache buffers.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

from . import policy
from .blocks import (
    Piece,
    Plan,
    chain_root,
    chains,
    content_key,
    materialize,
    plan,
)
from .codecs.base import dtype_name
from .errors import (
    CorruptBlobError,
    IdentityMismatchError,
    InvalidNameError,
    SessionNotFoundError,
    StoreFullError,
)
from .identity import ModelIdentity
from .snapshot import capture
from .stfile import write_tensors
from .store.blobs import FileBlobs, blob_metadata
from .store.index import BlockRef, Index, NewBlob, SnapshotRow
from .store.schema import connect
from .store.types import EntryInfo, GcReport, Problem, Restored, StoreStats

__all__ = ["Store", "check_name"]

log = logging.getLogger("persist")
DEFAULT_BLOCK = 256
MAX_NAME = 1024


def check_name(value: Any, what: str) -> str:
    """Session and namespace names are plain keys: any text of 1..1024 characters, no NUL."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or "\x00" in value:
        raise InvalidNameError(f"{what} must be 1 to {MAX_NAME} characters of text without NUL")
    return value


def pack_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def unpack_tokens(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


class Store:
    """A directory of cached states: ``Store(root, max_bytes=None, block_tokens=256)``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        block_tokens: int | None = None,
    ) -> None:
        self.root = Path(root)
        if not self.root.exists():
            self.root.mkdir(mode=0o700, parents=True)
        if block_tokens is not None and not 1 <= block_tokens <= 1 << 20:
            raise ValueError("block_tokens must be between 1 and 1048576")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.blobs = FileBlobs(self.root)
        db = connect(
            self.root / "index.sqlite", block_tokens or DEFAULT_BLOCK, adopt=block_tokens is None
        )
        for suffix in ("", "-wal", "-shm"):
            p = self.root / f"index.sqlite{suffix}"
            if p.exists():
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
        cache: Sequence[Any],
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        session: str | None = None,
        namespace: str = "default",
        pin: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> EntryInfo:
        """Save ``cache`` (covering exactly ``tokens``); named if ``session`` is given."""
        role = "prefix" if session is None else "session"
        return self._save(cache, tokens, identity, namespace, session, None, role, pin, metadata)

    def _save(
        self,
        cache: Sequence[Any],
        tokens: Sequence[int],
        identity: ModelIdentity,
        namespace: str,
        name: str | None,
        owner: str | None,
        role: str,
        pin: bool,
        metadata: Mapping[str, str] | None,
    ) -> EntryInfo:
        check_name(namespace, "namespace")
        if name is not None:
            check_name(name, "session")
        meta = dict(metadata or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise TypeError("metadata must map strings to strings")
        snap = capture(list(cache), tokens)
        toks = snap.tokens or []
        p = plan(snap, self.block_tokens, dtype_name)
        estimate = sum(s.nbytes for s in p.specs.values())
        if self.max_bytes is not None and estimate > self.max_bytes:
            raise StoreFullError(estimate, self.max_bytes)
        secret = self.index.secret(namespace, lambda: os.urandom(32))
        chs = chains(chain_root(secret, identity.digest), toks, self.block_tokens)
        for _attempt in range(3):
            written: list[NewBlob] = []
            try:
                refs, tail = self._write_blobs(p, chs, secret, len(toks), written)
                sid = self._commit(
                    p,
                    snap,
                    toks,
                    chs,
                    refs,
                    tail,
                    written,
                    identity,
                    namespace,
                    name,
                    owner,
                    role,
                    pin,
                    meta,
                )
            except BaseException:
                for b in written:
                    self.blobs.delete(b.file)
                raise
            if sid is not None:
                self._collect()
                self.index.count(namespace, saves=1, bytes_written=sum(b.size for b in written))
                row = self.index.get(sid)
                assert row is not None
                return self._info(row)
            for b in written:  # a reused blob died under us: write everything again
                self.blobs.delete(b.file)
        raise RuntimeError("the store kept collecting blobs this save meant to reuse")

    def _write_blobs(
        self, p: Plan, chs: list[bytes], secret: bytes, n: int, written: list[NewBlob]
    ) -> tuple[list[BlockRef], str]:
        refs = []
        for i in range(n // self.block_tokens):
            pieces = p.block_pieces(i) if p.split else []
            blob = self._put(secret, b"block", pieces, written) if pieces else None
            refs.append(BlockRef(i, chs[i + 1], blob))
        tail = self._put(secret, b"tail", p.tail_pieces(n), written)
        return refs, tail

    def _put(self, secret: bytes, role: bytes, pieces: list[Piece], written: list[NewBlob]) -> str:
        mats = materialize(pieces)
        key = content_key(secret, role, mats)
        existing = self.index.live_blob(key)
        if existing is not None:
            return existing[0]
        items = [(pc.key, pc.spec, (lambda v=view: v)) for pc, view, _ in mats]
        meta_role = role.decode()

        def write(sink: Any) -> bytes:
            write_tensors(sink, items, lambda sums: blob_metadata(meta_role, sums))
            return bytes(sink.head_digest)

        file, size, head = self.blobs.put(key, write)
        written.append(NewBlob(file, key, size, head))
        return file

    def _commit(
        self,
        p: Plan,
        snap: Any,
        toks: list[int],
        chs: list[bytes],
        refs: list[BlockRef],
        tail: str,
        written: list[NewBlob],
        identity: ModelIdentity,
        namespace: str,
        name: str | None,
        owner: str | None,
        role: str,
        pin: bool,
        meta: dict[str, str],
    ) -> int | None:
        new_files = {b.file for b in written}
        used = [f for f in [tail, *(r.blob for r in refs if r.blob)] if f not in new_files]
        with self.index.write() as db:
            if not Index.blobs_alive(db, used):
                return None
            Index.add_blobs(db, namespace, written)
            now = time.time()
            n_blocks = len(refs)
            files = sorted({tail, *(r.blob for r in refs if r.blob)})
            marks = ",".join("?" * len(files))
            sizes = dict(
                db.execute(
                    f"SELECT file, size FROM blobs WHERE file IN ({marks})", files
                ).fetchall()
            )
            row = {
                "namespace": namespace,
                "name": name,
                "owner": owner or name,
                "role": role,
                "identity": identity.digest,
                "identity_map": msgpack.packb(identity.to_dict(), use_bin_type=True),
                "root": chs[0],
                "last_chain": chs[n_blocks],
                "n_blocks": n_blocks,
                "n_tokens": len(toks),
                "tokens": pack_tokens(toks),
                "trimmable": int(snap.trimmable),
                "min_resume": snap.min_resume_offset,
                "manifest": p.manifest(),
                "tail": tail,
                "bytes": sum(sizes.values()),
                "pinned": int(pin),
                "created": now,
                "used": now,
                "metadata": msgpack.packb(meta, use_bin_type=True),
            }
            if name is not None:
                self._retire(db, namespace, name, identity.digest, snap, toks)
            sid = Index.insert(db, row, refs)
            if self.max_bytes is not None:
                self._evict(db, self.max_bytes, frozenset({sid}))
                total = self.index.unique_bytes(db)
                if total > self.max_bytes:  # pinned entries leave no room: undo it all
                    raise StoreFullError(total, self.max_bytes)
        return sid

    def _retire(
        self, db: Any, namespace: str, name: str, digest: str, snap: Any, toks: list[int]
    ) -> None:
        """Replace the session's previous snapshot: supersede it, or keep it as a checkpoint."""
        olds = Index.rows_where(
            db,
            "namespace = ? AND (name = ? OR (name IS NULL AND owner = ?))",
            [namespace, name, name],
        )
        for old in olds:
            old_toks = unpack_tokens(old.tokens)
            is_prefix = old.identity == digest and toks[: len(old_toks)] == old_toks
            if policy.supersedes(
                len(toks), snap.trimmable, snap.min_resume_offset, old.n_tokens, is_prefix
            ):
                Index.remove(db, old.id)
            elif old.name is None:
                continue  # a checkpoint that stays useful
            elif is_prefix and old.n_tokens < len(toks):
                # an untrimmable successor cannot serve this prefix: keep it
                db.execute(
                    "UPDATE snapshots SET name = NULL, role = 'checkpoint' WHERE id = ?", [old.id]
                )
            else:
                Index.remove(db, old.id)

    def _evict(self, db: Any, budget: int, protect: frozenset[int]) -> None:
        entries, sizes = Index.eviction_entries(db)
        ids = policy.plan_eviction(
            [policy.EvictEntry(i, u, pin, blobs) for i, u, pin, blobs in entries],
            sizes,
            budget,
            protect,
        )
        for sid in ids:
            Index.remove(db, sid)

    def _collect(self) -> int:
        """Unlink blob files whose last reference was committed away."""
        dead = self.index.collect()
        for f in dead:
            self.blobs.delete(f)
        self.index.forget(dead)
        return len(dead)

    # -- reading ----------------------------------------------------------

    def restore(
        self, session: str, *, identity: ModelIdentity, namespace: str = "default"
    ) -> Restored:
        """The named session, as fresh caches, exactly as saved."""
        row = self.index.by_name(check_name(namespace, "namespace"), check_name(session, "session"))
        if row is None:
            raise SessionNotFoundError(session, namespace)
        if row.identity != identity.digest:
            saved = ModelIdentity.from_dict(msgpack.unpackb(row.identity_map, raw=False))
            raise IdentityMismatchError(f"session {session!r}", saved.diff(identity))
        from .assemble import load_snapshot

        cache = load_snapshot(self, row)
        self.index.touch(row.id)
        self.index.count(namespace, restores=1, restored_tokens=row.n_tokens)
        return Restored(cache, unpack_tokens(row.tokens), self._info(row))

    def lookup(
        self, tokens: Sequence[int], *, identity: ModelIdentity, namespace: str = "default"
    ) -> Restored | None:
        """The longest usable stored prefix of ``tokens`` (at least one token is left over)."""
        from .assemble import load_snapshot

        toks = [int(t) for t in tokens]
        check_name(namespace, "namespace")
        secret = self.index.secret(namespace, lambda: os.urandom(32))
        chs = chains(chain_root(secret, identity.digest), toks, self.block_tokens)
        rows = {r.id: r for r in self.index.candidates(namespace, identity.digest, chs, len(toks))}
        cands = [
            (
                policy.Candidate(r.id, r.n_tokens, r.trimmable, r.min_resume, r.used),
                policy.common_prefix(unpack_tokens(r.tokens), toks),
            )
            for r in rows.values()
        ]
        while cands:
            choice = policy.choose(cands, len(toks))
            if choice is None:
                break
            row = rows[choice.candidate.id]
            try:
                cache = load_snapshot(self, row)
            except CorruptBlobError as e:
                log.warning("persist: skipping a damaged snapshot in lookup: %s", e)
                self.index.count(namespace, corrupt_skipped=1)
                cands = [c for c in cands if c[0].id != row.id]
                continue
            if choice.prefix < row.n_tokens:
                for c in cache:
                    c.trim(row.n_tokens - choice.prefix)
            self.index.touch(row.id)
            self.index.count(namespace, hits=1, restored_tokens=choice.prefix)
            return Restored(cache, toks[: choice.prefix], self._info(row))
        self.index.count(namespace, misses=1)
        return None

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
                if budget is not None:
                    victims = self._evict_report(db, budget)
                if dry_run:
                    after = self.index.unique_bytes(db)
                    raise _Rollback(GcReport(victims, 0, before - after, after, True))
        except _Rollback as r:
            return r.report
        deleted = self._collect()
        after = self.index.unique_bytes()
        return GcReport(victims, deleted, before - after, after, False)

    def _evict_report(self, db: Any, budget: int) -> list[EntryInfo]:
        entries, sizes = Index.eviction_entries(db)
        ids = policy.plan_eviction(
            [policy.EvictEntry(i, u, pin, b) for i, u, pin, b in entries], sizes, budget
        )
        rows = {r.id: r for r in Index.rows_where(db, "1 = 1", [])}
        victims = [self._info(rows[i]) for i in ids]
        for sid in ids:
            Index.remove(db, sid)
        return victims

    def stats(self, namespace: str | None = None) -> StoreStats:
        rows = self.index.snapshots(namespace, named_only=False)
        return StoreStats(
            entries=len(rows),
            sessions=sum(1 for r in rows if r.name is not None),
            unique_bytes=self.index.unique_bytes(),
            referenced_bytes=sum(r.nbytes for r in rows),
            counters=self.index.counters(namespace),
        )

    def check(self, fix: bool = False) -> list[Problem]:
        """Reconcile index and files; with ``fix`` repair what can be repaired."""
        from .store.check import check_store

        return check_store(self.index, self.blobs, fix)

    # -- helpers ------------------------------------------------------------

    def _info(self, r: SnapshotRow) -> EntryInfo:
        body = msgpack.unpackb(r.manifest, raw=False)
        ident = msgpack.unpackb(r.identity_map, raw=False)
        return EntryInfo(
            id=r.id,
            namespace=r.namespace,
            session=r.name,
            role=r.role,
            owner=r.owner,
            tokens=r.n_tokens,
            bytes=r.nbytes,
            trimmable=r.trimmable,
            min_resume_offset=r.min_resume,
            kinds=[layer["kind"] for layer in body["layers"]],
            identity=r.identity,
            model=str(ident.get("name", "")),
            created=r.created,
            used=r.used,
            pinned=r.pinned,
            metadata=msgpack.unpackb(r.metadata, raw=False),
        )


class _Rollback(Exception):
    """Raised inside a write transaction to undo it (a dry run) and carry the result."""

    def __init__(self, report: GcReport) -> None:
        self.report = report
