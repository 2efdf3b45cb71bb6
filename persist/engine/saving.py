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
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .. import policy, servable
from ..codecs.base import dtype_name
from ..codecs.snapshot import Snapshot
from ..errors import (
    SaveLostError,
    SessionConflictError,
    StoreBusyError,
    StoreFullError,
)
from ..format.tokens import pack_tokens, unpack_tokens
from ..identity import ModelIdentity
from ..records import Progress
from ..storage import retention, writes
from ..storage.blobs import BlobStore
from ..storage.index import BlockRef, Index, NewBlob, SnapshotRow
from ..storage.leases import Lease
from ..yielding import at_commit
from .blob_writes import write_blobs
from .blocks import Plan, chain_root, chains, head_key, plan
from .layer_checks import (
    holds_quantized,
    quantized_start,
)
from .unverified import UNVERIFIED_KEY, inherits_unverified

__all__ = ["Target", "write_and_commit"]

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclass(frozen=True, kw_only=True)
class Target:
    """What a save is for: the model, where it goes, and how it is kept."""

    identity: ModelIdentity
    namespace: str = "default"
    name: str | None = None  # a named session
    owner: str | None = None  # the session a checkpoint belongs to
    role: str = "prefix"  # "session" | "checkpoint" | "prefix"
    # None: the session's (a pin belongs to the session: its next turn keeps it)
    pin: bool | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    # the session's version (EntryInfo.id) the caller read; 0: it must not exist yet
    if_version: int | None = None
    # the tokens are the caller's word (an imported recurrent cache): see unverified.py
    unverified: bool = False
    # retention hints (ttl seconds, priority): policy.eviction_key; None: the session's
    hints: tuple[float, int] | None = None


def write_and_commit(
    index: Index,
    blobs: BlobStore,
    snap: Snapshot,
    target: Target,
    *,
    block_tokens: int,
    budgets: retention.Budgets,
    progress: Progress | None = None,
    keep_unpushed: bool = False,
) -> SnapshotRow:
    """Write blocks and tail of a checked snapshot, commit it; return its row as
    committed (steps 3 and 4 of ``engine.save_pipeline``).

    A session saved again (turn n+1) writes only the blocks whose bytes changed:
    every block is hashed in full and one whose content key is a live blob is
    taken as it is (``blob_writes._put``).  Nothing short of the bytes is trusted: MLX writes
    in place (``c.keys[..., 5, :] = x``) keep the Python object and its buffer,
    so no identity or fingerprint can prove a block unchanged (docs/FORMAT.md).
    ``keep_unpushed`` (a store with tiers): budget eviction keeps named sessions no
    tier holds yet (``retention.UNPUSHED``)."""
    toks = snap.tokens or []
    p = plan(snap, block_tokens, dtype_name)
    estimate = sum(s.nbytes for s in p.specs.values())
    for budget, whose in _budgets(budgets, target.namespace):
        if budget is not None and estimate > budget:
            raise StoreFullError(
                estimate, budget, f"snapshot needs {estimate} bytes but {whose} is {budget} bytes"
            )
    secret = index.secret(target.namespace, lambda: os.urandom(32))
    assert secret is not None
    chs = chains(chain_root(secret, target.identity.digest), toks, block_tokens)
    save = _Attempt(index, blobs, p, snap, target, chs, secret, block_tokens, budgets, estimate)
    for _attempt in range(3):
        done = save.once(progress, keep_unpushed)
        if done is not None:
            row, wrote = done
            retention.collect(index, blobs)
            index.count(target.namespace, saves=1, bytes_written=wrote)
            return row
    raise StoreBusyError("the store kept collecting blobs this save meant to reuse")


@dataclass
class _Attempt:
    """One try at writing a save's blobs and committing them (``write_and_commit``
    tries again where a blob it meant to reuse was collected meanwhile)."""

    index: Index
    blobs: BlobStore
    p: Plan
    snap: Snapshot
    target: Target
    chs: list[bytes]
    secret: bytes
    block_tokens: int
    budgets: retention.Budgets
    estimate: int

    def once(
        self, progress: Progress | None, keep_unpushed: bool
    ) -> tuple[SnapshotRow, int] | None:
        """The committed row and the bytes of the new blobs it wrote, or None (nothing
        of this try left behind) where a reused blob died before the commit."""
        index, blobs = self.index, self.blobs
        written: list[NewBlob] = []
        # held until the pending row is gone: check leaves a save alone while it is
        lease = _take_lease(blobs, self.estimate, self.budgets)
        salt = lease.salt
        try:
            index.begin_pending(salt)
            refs, tail = write_blobs(
                index, blobs, self.p, chs=self.chs, secret=self.secret,
                block_tokens=self.block_tokens, written=written, progress=progress, salt=salt,
            )  # fmt: skip
            with at_commit():  # verdicts read the store without this save (serve.judgements)
                done = _commit(
                    index, blobs, self.p, snap=self.snap, chs=self.chs, refs=refs, tail=tail,
                    written=written, target=self.target, salt=salt, budgets=self.budgets,
                    keep_unpushed=keep_unpushed,
                )  # fmt: skip
        except BaseException as e:
            # Decide by the index, not by the exception: a Ctrl-C that lands
            # just after the COMMIT must not unlink what the commit references.
            if isinstance(e, SaveLostError) or not _committed(index, salt):
                for b in written:
                    blobs.delete(b.file)
                with contextlib.suppress(Exception):
                    index.end_pending(salt)
            lease.release()
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise _full(self.estimate, self.budgets, e) from e
            raise
        if done is not None:
            lease.release()
            return done, sum(b.size for b in written)
        for b in written:  # a reused blob died under us: write everything again
            blobs.delete(b.file)
        index.end_pending(salt)
        lease.release()
        return None


def _take_lease(blobs: BlobStore, estimate: int, budgets: retention.Budgets) -> Lease:
    try:
        return blobs.lease()
    except OSError as e:
        if e.errno in DISK_FULL:
            raise _full(estimate, budgets, e) from e
        raise


def _full(estimate: int, budgets: retention.Budgets, e: OSError) -> StoreFullError:
    why = f"the disk is full ({e.strerror}); nothing was saved"
    return StoreFullError(estimate, budgets.max_bytes or 0, why)


def _committed(index: Index, salt: str) -> bool:
    """Did the save registered under ``salt`` commit?  Its commit deletes the pending row."""
    try:
        return salt not in index.pending()
    except Exception:
        return True  # the index cannot say: keep the files (check removes orphans)


def _commit(
    index: Index,
    blobs: BlobStore,
    p: Plan,
    *,
    snap: Snapshot,
    chs: list[bytes],
    refs: list[BlockRef],
    tail: str,
    written: list[NewBlob],
    target: Target,
    salt: str,
    budgets: retention.Budgets,
    keep_unpushed: bool,
) -> SnapshotRow | None:
    t, namespace, toks = target, target.namespace, snap.tokens or []
    # a quantized snapshot serves no prefix of quantized_kv_start tokens or fewer
    floor = servable.kv_bits_floor(
        snap.min_resume_offset, holds_quantized(snap.records), quantized_start(t.identity)
    )
    new_files = {b.file for b in written}
    used = [f for f in [tail, *(r.blob for r in refs if r.blob)] if f not in new_files]
    with index.write() as db:
        if not writes.blobs_alive(db, used):
            return None
        writes.add_blobs(db, namespace, written)
        writes.finish_pending(db, salt, sorted(new_files), blobs.exists)
        now = time.time()
        if t.name is not None:
            now = writes.version_after(db, namespace, t.name, now)
        n_blocks = len(refs)
        sizes = writes.blob_sizes(db, [tail, *(r.blob for r in refs if r.blob)])
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
            "min_resume": floor,
            "manifest": p.manifest(),
            "tail": tail,
            "bytes": sum(sizes.values()),
            "pinned": 0,  # the save's own, else its session's: ``_pinned``
            "created": now,
            "used": now,
            "metadata": msgpack.packb(t.metadata, use_bin_type=True),
        }
        if t.name is not None:
            _check_version(db, t)
        who = t.name if t.name is not None else t.owner  # a checkpoint: its session's
        if who is not None and (t.unverified or inherits_unverified(db, namespace, who, toks)):
            row["min_resume"] = len(toks) + 1  # no prefix of it, not even all, serves
            row["metadata"] = msgpack.packb(
                {**t.metadata, UNVERIFIED_KEY: "true"}, use_bin_type=True
            )
        hints = _hints(db, t, namespace, who)  # read before the session's old row goes
        row["pinned"] = int(_pinned(db, t, namespace, who))
        if t.name is not None:
            writes.retire_session(
                db,
                namespace,
                t.name,
                digest=t.identity.digest,
                trimmable=snap.trimmable,
                floor=floor,
                toks=toks,
            )
        elif t.role == "prefix":
            covered = _replace_covered(
                db,
                namespace,
                t.identity.digest,
                trimmable=snap.trimmable,
                floor=floor,
                toks=toks,
                chs=chs,
                block=p.block,
            )
            hints = policy.stronger_hints(hints, covered)
        elif t.owner is not None:  # a checkpoint saved again (a resumed prime): one row
            _replace_same_checkpoint(db, namespace, t.owner, t.identity.digest, toks)
        sid = writes.insert(db, row, refs)
        if hints is not None:
            writes.set_hints(db, [sid], *hints)
        writes.add_heads(db, sid, chs, toks, p.block)
        # read back in this transaction: another process may evict it right after
        (committed,) = Index.rows_where(db, "id = ?", [sid])
        _evict(db, index, budgets, namespace, frozenset({sid}), keep_unpushed)
    return committed


def _budgets(budgets: retention.Budgets, namespace: str) -> list[tuple[int | None, str]]:
    owner = retention.budget_owner(namespace)
    return [
        (budgets.max_bytes, "the store's budget"),
        (budgets.of(namespace), f"namespace {owner!r}'s budget"),
    ]


def _hints(db: Any, t: Target, namespace: str, who: str | None) -> tuple[float, int] | None:
    """The new row's retention hints: the save's own, else its session's (a session
    keeps its hints from turn to turn, and its checkpoints share them)."""
    if t.hints is not None:
        return t.hints
    return writes.session_hints(db, namespace, who) if who is not None else None


def _pinned(db: Any, t: Target, namespace: str, who: str | None) -> bool:
    """The new row's pin: the save's own, else its session's (attack 38f, F2: a pinned
    session's next turn was unpinned, and gc evicted it; only unpin drops a pin)."""
    if t.pin is not None:
        return t.pin
    return who is not None and writes.session_pinned(db, namespace, who)


def _check_version(db: Any, t: Target) -> None:
    """Refuse to overwrite a session that changed since the caller read it."""
    if t.if_version is None or t.name is None:
        return
    current = next((r.id for r in writes.session_rows(db, t.namespace, t.name) if r.name), 0)
    if current != t.if_version:
        raise SessionConflictError(t.name, t.namespace, t.if_version, current)


def _replace_same_checkpoint(
    db: Any, namespace: str, owner: str, digest: str, toks: list[int]
) -> None:
    for old in writes.session_rows(db, namespace, owner):
        if old.name is None and old.identity == digest and unpack_tokens(old.tokens) == toks:
            writes.remove(db, old.id)


def _replace_covered(
    db: Any,
    namespace: str,
    digest: str,
    *,
    trimmable: bool,
    floor: int,
    toks: list[int],
    chs: list[bytes],
    block: int,
) -> tuple[float, int] | None:
    """Anonymous entries the new one covers (``policy.covers``) go: rows stay
    bounded by distinct prefixes.  Their strongest retention hints, which the new
    one keeps: it serves their prefixes now.  A pinned one stays (only unpinning
    ends a pin; attack r15: it went, its pin not passed on, and gc took the rest)."""
    hints = None
    olds = retention.anonymous_prefixes_of(
        db, namespace, digest, chains=chs, tokens=toks, block=block
    )
    for old in (o for o in olds if not o.pinned):
        old_toks = unpack_tokens(old.tokens)
        is_prefix = toks[: len(old_toks)] == old_toks
        if policy.covers(len(toks), trimmable, floor, len(old_toks), is_prefix):
            hints = policy.stronger_hints(hints, writes.hints_of(db, old.id))
            writes.remove(db, old.id)
    return hints


def _evict(
    db: Any,
    index: Index,
    budgets: retention.Budgets,
    namespace: str,
    protect: frozenset[int],
    keep_unpushed: bool,
) -> None:
    """Evict down to the budgets; with namespace budgets, only in this namespace.

    If pinned or protected entries (or, with ``keep_unpushed``, named sessions no
    tier holds yet: their only copy) leave no room, StoreFullError undoes the whole
    transaction, naming those sessions.
    """
    limits, scope = budgets.limits(namespace), budgets.scope(namespace)
    _, over = retention.evict_lru(db, index, limits, scope, protect, keep_unpushed)
    if over is not None:
        kept = retention.unpushed_count(db, protect) if keep_unpushed else 0
        raise StoreFullError(*over, retention.over_budget(*over, kept))
