"""Pulling a checked record's snapshot into the local store: its blobs the store lacks,
checked against the record before a byte is written, then the row committed exactly as a
local save would commit it, its chains under this store's own namespace secret."""

from __future__ import annotations

import io
import sqlite3
import time
from pathlib import Path
from typing import Any

from ...errors import CorruptBlobError
from ...format.tokens import unpack_tokens
from ...remote.redis_tier import namespace_tag
from ...storage import full, writes
from ...storage.blobs import BlobStore
from ...storage.check import verify_blob
from ...storage.index import Index
from ...storage.rows import BlockRef, NewBlob
from .records import ROW_FIELDS, TAG_BYTES, BadValue, Keys, block_of, chains_under

__all__ = ["EvictedError", "pull", "relation"]

Tier = Any  # a RedisTier or S3Tier


class EvictedError(CorruptBlobError):
    """A value the tier dropped (an LRU may drop anything): a miss, not damage."""


def pull(
    index: Index,
    blobs: BlobStore,
    tier: Tier,
    *,
    keys: Keys,
    namespace: str,
    body: dict[str, Any],
    named: bool,
    replace: int | None = None,
) -> int:
    """Commit a checked record's snapshot into the local store (as a session if
    ``named``, else an anonymous prefix); CorruptBlobError if a blob fails its checks.
    Blobs this store holds are not fetched; the others a few at a time (the tier's
    threads hold a few blobs in memory, never the whole session).  ``replace``: this
    store's own snapshot of the name, which the record continues (``relation``
    ``newer``): retired in the commit's transaction, as a save retires its last turn."""
    for _ in range(_ATTEMPTS):
        try:
            sid = _attempt(
                index, blobs, tier, keys=keys, namespace=namespace, body=body, named=named,
                replace=replace,
            )  # fmt: skip
        except OSError as e:  # a blob or lease write found the disk full: typed, as a save's
            if e.errno in full.DISK_FULL:  # (nothing of the attempt is kept: ``_attempt``)
                raise full.disk_full_error(getattr(blobs, "root", Path("the store")), e) from e
            raise
        if sid is not None:
            return sid
    # a store whose rm/gc keeps killing the blobs the pull reuses: a miss, never a row
    # that names dead blob files
    raise BadValue("conflict", f"the local store dropped reused blobs {_ATTEMPTS} times")


_ATTEMPTS = 3  # each retry fetches the blobs that died; a third loss is not a race


def _attempt(
    index: Index,
    blobs: BlobStore,
    tier: Tier,
    *,
    keys: Keys,
    namespace: str,
    body: dict[str, Any],
    named: bool,
    replace: int | None,
) -> int | None:
    """One pull: the snapshot id, or None if a reused local blob died before the commit
    (a concurrent rm/gc collected it); nothing of this attempt is then kept."""
    facts = body["blobs"]
    files = {k: held[0] for k in facts if (held := index.live_blob(k)) is not None}
    reused = sorted(set(files.values()))
    names = {keys.blob_name(k): k for k in facts if k not in files}  # on the tier
    lease = blobs.lease()  # held until the pending row is gone (check leaves the pull alone)
    salt = lease.salt
    written: list[NewBlob] = []
    tag_bytes, where = TAG_BYTES if keys.key is not None else 0, namespace_tag(namespace).encode()

    def then(name: str, data: bytes, tag: bytes) -> str:
        # on a checking thread (fetch_all): the tag's HMAC (hashlib lets go of the
        # GIL), the checks and the local write of one blob while the next arrives
        key = names[name]
        try:
            keys.check(b"blob", tag, where, key.encode(), data)
        except BadValue:
            tier.marks.bad(namespace, name)  # the next push of it reads it and repairs it
            raise
        return _local(blobs, key, data, facts=facts[key], salt=salt, written=written)

    try:
        index.begin_pending(salt)
        sizes = {n: int(facts[k][0]) for n, k in sorted(names.items())}
        for name, file in tier.get_blobs(namespace, sizes, tag_bytes, then).items():
            if file is None:
                raise EvictedError(f"shared blob {names[name]}", "the tier no longer holds it")
            files[names[name]] = file
        sid = _commit(
            index,
            blobs,
            namespace,
            body=body,
            files=files,
            reused=reused,
            written=written,
            salt=salt,
            named=named,
            replace=replace,
        )
        if sid is None:
            _undo(index, blobs, written, salt)
    except BaseException:
        _undo(index, blobs, written, salt)
        raise
    finally:
        lease.release()
    return sid


def _undo(index: Index, blobs: BlobStore, written: list[NewBlob], salt: str) -> None:
    for b in written:
        blobs.delete(b.file)
    index.end_pending(salt)


def _local(
    blobs: BlobStore,
    key: str,
    data: bytes,
    *,
    facts: list[Any],
    salt: str,
    written: list[NewBlob],
) -> str:
    """The local file of blob ``key`` from the tier's bytes (its tag checked), checked
    (its size, its header against the record, every tensor against its checksum)."""
    where = f"shared blob {key}"
    size, digest = facts[0], bytes(facts[1])
    # every tensor checked in memory, before a byte is written or committed
    problem = verify_blob(io.BytesIO(data), where, size, digest, len(data))
    if problem is not None:
        raise CorruptBlobError(where, problem)

    def write(sink: Any) -> bytes:
        sink.write(data)
        sink.finish()
        return digest

    file, n, h = blobs.put(key, write, len(data), salt)
    written.append(NewBlob(file, key, n, h))
    return file


def _commit(
    index: Index,
    blobs: BlobStore,
    namespace: str,
    *,
    body: dict[str, Any],
    files: dict[str, str],
    reused: list[str],
    written: list[NewBlob],
    salt: str,
    named: bool,
    replace: int | None = None,
) -> int | None:
    r = {k: body["row"][k] for k in ROW_FIELDS}
    # the tier's chains are under the tier's secret; this store's under its own
    secret = index.secret(namespace)
    assert secret is not None  # adopted (``secret``) before anything is pulled
    chs, r["last_chain"] = chains_under(secret, r, len(body["blocks"]))
    r["root"] = chs[0]
    refs = [
        BlockRef(i, c, files[k] if k else None)
        for (i, _, k), c in zip(body["blocks"], chs[1:], strict=True)
    ]
    row = {
        **r,
        "namespace": namespace,
        "name": r["name"] if named else None,
        "owner": r["owner"] if named else None,
        "role": r["role"] if named else "prefix",
        "trimmable": int(bool(r["trimmable"])),
        "tail": files[body["tail"]],
        "bytes": sum(f[0] for f in body["blobs"].values()),
        "pinned": 0,  # a pin is this store's: one replaced keeps its copy's (``_commit``)
        "used": time.time(),
    }
    try:
        with index.write() as db:
            # the local blobs reused were chosen before the fetch; a concurrent rm/gc may
            # have collected them since (retention.collect unlinks dead blobs): as a save
            # does, commit only if they are still alive, else the caller fetches them
            if not writes.blobs_alive(db, reused):
                return None
            writes.add_blobs(db, namespace, written)
            writes.finish_pending(db, salt, [b.file for b in written], blobs.exists)
            hints = None
            if replace is not None:  # the copy's pin and hints are the session's: kept
                row["pinned"] = int(writes.session_pinned(db, namespace, row["name"]))
                hints = writes.session_hints(db, namespace, row["name"])
                _retire(db, namespace, row, replace)
            sid = writes.insert(db, row, refs)
            if hints is not None:
                writes.set_hints(db, [sid], *hints)
            writes.add_heads(db, sid, chs, unpack_tokens(r["tokens"]), block_of(body))
    except sqlite3.IntegrityError:  # the name was taken meanwhile (another pull, a save)
        raise BadValue("conflict", "the local store took that name meanwhile") from None
    return sid


def relation(row: dict[str, Any], have: Any) -> str:
    """What a tier's session (its record's ``row``) is to this store's own snapshot of
    the name, ``have``: ``same`` (the same model and tokens: nothing to fetch), ``newer``
    (a later version whose tokens extend it: the fleet's turns this store did not
    pull), else ``other`` (another history, or an older version of this one)."""
    toks, mine = unpack_tokens(row["tokens"]), unpack_tokens(have.tokens)
    if row["identity"] != have.identity:
        return "other"
    if toks == mine:
        return "same"
    newer = float(row["created"]) > float(have.created)
    return "newer" if newer and toks[: len(mine)] == mine else "other"


def _retire(db: Any, namespace: str, row: dict[str, Any], replace: int) -> None:
    """The session's snapshots before a pulled newer version of it is committed, retired
    as a save's would be (``writes.retire_session``), where the named one is still
    ``replace`` (a save here meanwhile: a conflict, nothing replaced)."""
    for old in writes.session_rows(db, namespace, row["name"]):
        if old.name is not None and old.id != replace:
            raise BadValue("conflict", "the local session changed meanwhile")
    writes.retire_session(
        db, namespace, row["name"], digest=row["identity"], trimmable=bool(row["trimmable"]),
        floor=int(row["min_resume"]), toks=unpack_tokens(row["tokens"]),
    )  # fmt: skip
