"""Saving a snapshot into the store: blocks and tail first, then one commit.

The write protocol of docs/FORMAT.md: every blob is written to tmp,
fsynced and renamed into place before the transaction that references it;
blobs a save means to reuse are re-checked inside that transaction (a
concurrent collection may have killed them), and files are deleted only
after the commit that unreferenced them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from . import policy
from .blocks import Piece, Plan, chain_root, chains, content_key, head_key, materialize, plan
from .codecs.base import dtype_name
from .errors import NotResumableError, StoreFullError
from .identity import ModelIdentity
from .records import Progress
from .snapshot import Snapshot, capture
from .stfile import write_tensors
from .store import retention
from .store.blobs import blob_metadata
from .store.chains import check_tokens, pack_tokens, unpack_tokens
from .store.index import BlockRef, Index, NewBlob, SnapshotRow

if TYPE_CHECKING:
    from .sessions import Store

__all__ = ["Target", "save_snapshot", "pack_tokens", "unpack_tokens"]

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclass(frozen=True)
class Target:
    """What a save is for: the model, where it goes, and how it is kept."""

    identity: ModelIdentity
    namespace: str = "default"
    name: str | None = None  # a named session
    owner: str | None = None  # the session a checkpoint belongs to
    role: str = "prefix"  # "session" | "checkpoint" | "prefix"
    pin: bool = False
    metadata: dict[str, str] = field(default_factory=dict)


def save_snapshot(
    store: Store,
    cache: Sequence[Any] | Snapshot,
    tokens: Sequence[int],
    target: Target,
    progress: Progress | None = None,
) -> SnapshotRow:
    """Write blocks and tail, commit the snapshot; return its row as committed."""
    identity, namespace = target.identity, target.namespace
    snap = cache if isinstance(cache, Snapshot) else capture(list(cache), tokens)
    if isinstance(cache, Snapshot) and snap.tokens != check_tokens(tokens):
        raise NotResumableError("a captured snapshot is saved with the tokens it was captured with")
    toks = snap.tokens or []
    p = plan(snap, store.block_tokens, dtype_name)
    estimate = sum(s.nbytes for s in p.specs.values())
    for budget in (store.max_bytes, store.namespace_budget(namespace)):
        if budget is not None and estimate > budget:
            raise StoreFullError(estimate, budget)
    secret = store.index.secret(namespace, lambda: os.urandom(32))
    assert secret is not None
    chs = chains(chain_root(secret, identity.digest), toks, store.block_tokens)
    for _attempt in range(3):
        written: list[NewBlob] = []
        salt = secrets.token_hex(6)
        store.index.begin_pending(salt)
        try:
            refs, tail = _write_blobs(store, p, chs, secret, len(toks), written, progress, salt)
            done = _commit(store, p, snap, toks, chs, refs, tail, written, target, salt)
        except BaseException as e:
            # Decide by the index, not by the exception: a Ctrl-C that lands
            # just after the COMMIT must not unlink what the commit references.
            if not _committed(store, salt):
                for b in written:
                    store.blobs.delete(b.file)
                with contextlib.suppress(Exception):
                    store.index.end_pending(salt)
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise StoreFullError(
                    estimate,
                    store.max_bytes or 0,
                    f"the disk is full ({e.strerror}); nothing was saved",
                ) from e
            raise
        if done is not None:
            store._collect()
            store.index.count(namespace, saves=1, bytes_written=sum(b.size for b in written))
            return done
        for b in written:  # a reused blob died under us: write everything again
            store.blobs.delete(b.file)
        store.index.end_pending(salt)
    raise RuntimeError("the store kept collecting blobs this save meant to reuse")


def _committed(store: Store, salt: str) -> bool:
    """Did the save registered under ``salt`` commit?  Its commit deletes the pending row."""
    try:
        return salt not in store.index.pending()
    except Exception:
        return True  # the index cannot say: keep the files (check removes orphans)


def _write_blobs(
    store: Store,
    p: Plan,
    chs: list[bytes],
    secret: bytes,
    n: int,
    written: list[NewBlob],
    progress: Progress | None,
    salt: str,
) -> tuple[list[BlockRef], str]:
    refs = []
    blocks = n // store.block_tokens
    for i in range(blocks):
        pieces = p.block_pieces(i) if p.split else []
        blob = _put(store, secret, b"block", pieces, written, salt) if pieces else None
        refs.append(BlockRef(i, chs[i + 1], blob))
        if progress is not None:
            progress(i + 1, blocks + 1)
    tail = _put(store, secret, b"tail", p.tail_pieces(n), written, salt)
    if progress is not None:
        progress(blocks + 1, blocks + 1)
    return refs, tail


def _put(
    store: Store,
    secret: bytes,
    role: bytes,
    pieces: list[Piece],
    written: list[NewBlob],
    salt: str,
) -> str:
    mats = materialize(pieces)
    key = content_key(secret, role, mats)
    for b in written:  # the same bytes twice in one snapshot: one file
        if b.key == key:
            return b.file
    existing = store.index.live_blob(key)
    if existing is not None:
        return existing[0]
    items = [(pc.key, pc.spec, (lambda v=view: v)) for pc, view, _ in mats]
    meta_role = role.decode()

    def write(sink: Any) -> bytes:
        write_tensors(sink, items, lambda sums: blob_metadata(meta_role, sums))
        return bytes(sink.head_digest)

    size_hint = sum(pc.spec.nbytes for pc, _, _ in mats)
    file, size, head = store.blobs.put(key, write, size_hint, salt)
    written.append(NewBlob(file, key, size, head))
    return file


def _commit(
    store: Store,
    p: Plan,
    snap: Any,
    toks: list[int],
    chs: list[bytes],
    refs: list[BlockRef],
    tail: str,
    written: list[NewBlob],
    target: Target,
    salt: str,
) -> SnapshotRow | None:
    t, namespace = target, target.namespace
    new_files = {b.file for b in written}
    used = [f for f in [tail, *(r.blob for r in refs if r.blob)] if f not in new_files]
    with store.index.write() as db:
        if not Index.blobs_alive(db, used):
            return None
        Index.add_blobs(db, namespace, written)
        db.execute("DELETE FROM pending WHERE salt = ?", [salt])
        now = time.time()
        n_blocks = len(refs)
        files = sorted({tail, *(r.blob for r in refs if r.blob)})
        marks = ",".join("?" * len(files))
        sizes = dict(
            db.execute(f"SELECT file, size FROM blobs WHERE file IN ({marks})", files).fetchall()
        )
        row = {
            "namespace": namespace,
            "name": t.name,
            "owner": t.owner or t.name,
            "role": t.role,
            "identity": t.identity.digest,
            "identity_map": msgpack.packb(t.identity.to_dict(), use_bin_type=True),
            "root": chs[0],
            "last_chain": chs[n_blocks] if n_blocks else head_key(chs[0], toks),
            "n_blocks": n_blocks,
            "n_tokens": len(toks),
            "tokens": pack_tokens(toks),
            "trimmable": int(snap.trimmable),
            "min_resume": snap.min_resume_offset,
            "manifest": p.manifest(),
            "tail": tail,
            "bytes": sum(sizes.values()),
            "pinned": int(t.pin),
            "created": now,
            "used": now,
            "metadata": msgpack.packb(t.metadata, use_bin_type=True),
        }
        if t.name is not None:
            _retire(db, namespace, t.name, t.identity.digest, snap, toks)
        elif t.role == "prefix":
            _replace_covered(db, namespace, t.identity.digest, snap, toks, chs, n_blocks)
        sid = Index.insert(db, row, refs)
        Index.add_heads(db, sid, chs, toks, store.block_tokens)
        # read back in this transaction: another process may evict it right after
        (committed,) = Index.rows_where(db, "id = ?", [sid])
        _evict(db, store, namespace, frozenset({sid}))
    return committed


def _retire(db: Any, namespace: str, name: str, digest: str, snap: Any, toks: list[int]) -> None:
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


def _replace_covered(
    db: Any, namespace: str, digest: str, snap: Any, toks: list[int], chs: list[bytes], n: int
) -> None:
    """Anonymous entries that the new one covers go: rows stay bounded by distinct prefixes.

    Covered: the same tokens, or a prefix of them that the new entry can be
    trimmed back to (``policy.supersedes``).  A server that sees one prompt
    250 times keeps one entry, not 250.
    """
    ends = [*chs[1 : n + 1], head_key(chs[0], toks)]
    for old in retention.anonymous_ending_at(db, namespace, digest, ends):
        old_toks = unpack_tokens(old.tokens)
        if toks[: len(old_toks)] != old_toks:
            continue
        if len(old_toks) == len(toks) or policy.supersedes(
            len(toks), snap.trimmable, snap.min_resume_offset, old.n_tokens, True
        ):
            Index.remove(db, old.id)


def _evict(db: Any, store: Store, namespace: str, protect: frozenset[int]) -> None:
    """Evict down to the budgets; with namespace budgets, only in this namespace.

    If pinned or protected entries leave no room, StoreFullError undoes the
    whole transaction.
    """
    own = store.namespace_budget(namespace)
    scope = namespace if store.namespace_max_bytes is not None else None
    limits = [(b, ns) for b, ns in ((store.max_bytes, None), (own, namespace)) if b is not None]
    _, over = retention.evict_lru(db, store.index, limits, scope, protect)
    if over is not None:
        raise StoreFullError(*over)
