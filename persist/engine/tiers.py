"""Snapshots between the local store and a shared tier: push after a commit, pull on a miss.

A snapshot travels as a *record* (its index row, its block list by content
key, each blob's size and header checksum, and a checksum of all that) plus
its blobs.  Pulling writes the blobs into the local store, checked against the
record before anything is committed, then commits the row exactly as a local
save would; from then on the local store serves it.  A tier that fails never
fails the local operation: the caller counts it and goes on.
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import xxhash

from .. import policy
from ..errors import CorruptBlobError
from ..format.tokens import unpack_tokens
from ..store import writes
from ..store.blobs import BlobStore
from ..store.chains import boundary_heads, chain_root, chains
from ..store.check import verify_blob
from ..store.index import Index
from ..store.redis_tier import RedisTier, TierUnavailable
from ..store.rows import BlockRef, NewBlob
from ..store.s3_tier import S3Tier
from .costs import LOCAL, CostModel

__all__ = ["Shared", "push", "pull", "sync", "shared_secret", "EvictedError"]


class EvictedError(CorruptBlobError):
    """A value the tier dropped (an LRU may drop anything): a miss, not damage."""


log = logging.getLogger("persist")
Tier = RedisTier | S3Tier
PULL_AHEAD = 4  # blobs fetched (in parallel) before they are written locally
ROW_FIELDS = (
    "name", "owner", "role", "identity", "identity_map", "root", "last_chain", "n_blocks",
    "n_tokens", "tokens", "trimmable", "min_resume", "manifest", "metadata", "created",
)  # fmt: skip


class Shared:
    """A Store's shared tier: which namespaces agree with it, and the operations that
    never fail the local one (a tier that is down or refuses is counted and skipped)."""

    def __init__(self, tier: Tier, name: str = "shared") -> None:
        self.tier, self.name = tier, name  # name: the prefix of its counters in persist stats
        self._agreed: dict[str, bool] = {}

    def _count(self, index: Index, namespace: str, what: str) -> None:
        index.count(namespace, **{f"{self.name}_{what}": 1})

    def agree(self, index: Index, namespace: str, create: bool = False) -> bool:
        """Does this namespace's secret agree with the tier's?  Only a save (``create``)
        puts a secret on the tier: a read never creates a namespace anywhere."""
        if namespace not in self._agreed:
            ok = self._run(lambda: shared_secret(index, self.tier, namespace, create))
            if ok is None:
                return False  # down, or nothing shared yet: asked again next time
            self._agreed[namespace] = bool(ok)
        return self._agreed[namespace]

    def _run(self, op: Any) -> Any:
        try:
            return op()
        except TierUnavailable:
            return None

    def _bytes(self, index: Index, namespace: str, before: dict[str, int]) -> None:
        """Bytes this operation moved, into the store's counters (persist stats)."""
        for what in ("bytes_pushed", "bytes_pulled"):
            n = self.tier.counters.get(what, 0) - before.get(what, 0)
            if n:
                index.count(namespace, **{f"{self.name}_{what}": n})

    def push(self, index: Index, blobs: BlobStore, namespace: str, sid: int) -> None:
        if self.agree(index, namespace, create=True):
            before = dict(self.tier.counters)
            done = self._run(lambda: push(index, blobs, self.tier, namespace, sid))
            self._count(index, namespace, "pushes" if done else "errors")
            self._bytes(index, namespace, before)

    def pull_session(self, index: Index, blobs: BlobStore, namespace: str, name: str) -> None:
        """A named session the local store lacks, from the tier (CorruptBlobError if damaged)."""
        if not self.agree(index, namespace):
            return
        record = self._run(lambda: self.tier.session_record(namespace, name))
        if record is None:
            self._count(index, namespace, "misses")
            return
        before = dict(self.tier.counters)
        try:
            if self._run(lambda: pull(index, blobs, self.tier, namespace, record, named=True)):
                self._count(index, namespace, "hits")
        except EvictedError:  # the LRU took part of it: the session is not there
            self._count(index, namespace, "incomplete")
        self._bytes(index, namespace, before)

    def pull_prefix(
        self,
        index: Index,
        blobs: BlobStore,
        toks: list[int],
        identity: Any,
        namespace: str,
        block: int,
        costs: CostModel | None = None,
        max_cost: float | None = None,
    ) -> None:
        """Pull the tier's deepest snapshot of this prompt if it beats the local one
        (and, with ``costs``, if pulling and restoring it beats a prefill)."""
        from .reading import choose

        if not self.agree(index, namespace):  # adopts the fleet's secret on a new machine
            return
        secret = index.secret(namespace)
        if secret is None:
            return
        local = choose(index, toks, identity, namespace, block, set())
        every = chains(chain_root(secret, identity.digest), toks, block)
        heads = boundary_heads(every, toks, block)  # prefixes that end inside a block
        records = self._run(lambda: self.tier.deepest_chain(namespace, every[1:], heads)) or []
        found = best_record(records, toks)
        if found is None or found[0] <= (local[1] if local else 0):
            self._count(index, namespace, "misses")
            return
        usable, record, body = found
        if not self._worth(costs, identity, namespace, body, usable, max_cost):
            return
        before = dict(self.tier.counters)
        try:
            t0 = time.perf_counter()
            if self._run(lambda: pull(index, blobs, self.tier, namespace, record, named=False)):
                self._count(index, namespace, "hits")
                moved = self.tier.counters.get("bytes_pulled", 0) - before.get("bytes_pulled", 0)
                if costs is not None:
                    costs.restored(identity, self.name, moved, time.perf_counter() - t0)
            self._bytes(index, namespace, before)
        except EvictedError:  # a shorter hit or none, never an error
            self._count(index, namespace, "incomplete")
        except CorruptBlobError as e:  # never a wrong cache: the local answer stands
            self._count(index, namespace, "corrupt_skipped")
            log.warning("persist: skipping a damaged shared snapshot: %s", e)

    def _worth(
        self,
        costs: CostModel | None,
        identity: Any,
        namespace: str,
        body: dict[str, Any],
        usable: int,
        max_cost: float | None,
    ) -> bool:
        """Is pulling this record's blobs, then restoring ``usable`` tokens of them,
        predicted to beat a prefill of those tokens?"""
        if costs is None:
            return True
        nbytes = sum(int(v[0]) for v in body["blobs"].values())
        via = [(self.name, nbytes), (LOCAL, nbytes)]
        if costs.decide(identity, namespace, via, usable, max_cost).restore:
            return True
        self._count(costs.index, namespace, "declined")
        return False


def best_record(records: list[bytes], toks: list[int]) -> tuple[int, bytes, dict[str, Any]] | None:
    """(usable prefix, record, its checked body) of the candidate that serves the prompt
    furthest, by the resume policy over its stored tokens (an untrimmable snapshot
    only at its own length)."""
    best: tuple[int, bytes, dict[str, Any]] | None = None
    for record in records:
        try:
            body = _body(record)
        except CorruptBlobError:
            continue  # never used; a pull of it would refuse it too
        row = body["row"]
        stored = unpack_tokens(row["tokens"])
        pairs = enumerate(zip(stored, toks, strict=False))
        lcp = next((i for i, (a, b) in pairs if a != b), min(len(stored), len(toks)))
        n, trim, floor = len(stored), bool(row["trimmable"]), int(row["min_resume"])
        p = policy.usable_prefix(n, lcp, len(toks), trim, floor)
        if p and (best is None or p > best[0]):
            best = (p, record, body)
    return best


def open_tiers(shared: str | None, cold: str | None) -> tuple[Shared | None, Shared | None]:
    """The shared (Redis) and cold (S3) tiers of these URLs (None where not given)."""
    return (
        Shared(RedisTier(shared)) if shared else None,
        Shared(S3Tier(cold), "cold") if cold else None,
    )


def sync(
    index: Index, blobs: BlobStore, shared: list[Shared], namespace: str | None, names: list[str]
) -> dict[str, Any]:
    """Push every local snapshot (of ``namespace``) to the tiers (each push writes only
    what a tier lacks), then pull the named sessions this store lacks."""
    rows = index.snapshots(namespace, named_only=False)
    for row in rows:
        for tier in shared:
            tier.push(index, blobs, row.namespace, row.id)
    pulled = []
    for name in names:
        ns = namespace or "default"
        for tier in shared:
            if index.by_name(ns, name) is None:
                tier.pull_session(index, blobs, ns, name)
        if index.by_name(ns, name) is not None:
            pulled.append(name)
    return {"pushed": len(rows), "pulled": pulled, "missing": sorted(set(names) - set(pulled))}


def shared_secret(index: Index, tier: Tier, namespace: str, create: bool) -> bool | None:
    """Make the namespace's chain secret the tier's (so chains and content keys agree on
    every machine); False if this store already chained it with another one; None if
    the tier has none and ``create`` is false."""
    local = index.secret(namespace)
    if not create:
        held = tier.get_secret(namespace)
        if held is None:
            return None
        theirs = held
    else:
        theirs = tier.secret(namespace, local if local is not None else os.urandom(32))
    if local is None:
        local = index.set_secret(namespace, theirs)
    if local != theirs:
        log.warning(
            "persist: namespace %r has another secret on %s: not shared", namespace, tier.url
        )
        return False
    return True


def push(index: Index, blobs: BlobStore, tier: Tier, namespace: str, sid: int) -> bool:
    """Write a committed snapshot's missing blobs and its record to the tier."""
    with index.read() as db:
        (row,) = Index.rows_where(db, "id = ?", [sid])
        refs = Index.blocks_in(db, sid)
    files = [row.tail, *(r.blob for r in refs if r.blob)]
    facts = index.blob_facts(files)
    if len(facts) != len(set(files)):
        return True  # evicted or replaced meanwhile: nothing to share
    by_key = {facts[f][0]: f for f in set(files)}

    def put(key: str) -> None:
        with blobs.open(by_key[key]) as fh:
            tier.put_blob(namespace, key, fh.read(), bool(row.pinned))

    with ThreadPoolExecutor(4) as pool:  # the tier's client is thread-safe
        list(pool.map(put, tier.missing_blobs(namespace, sorted(by_key))))
    body = {
        "v": 1,
        "row": {k: getattr(row, k) for k in ROW_FIELDS},
        "blocks": [[r.idx, r.chain, facts[r.blob][0] if r.blob else None] for r in refs],
        "tail": facts[row.tail][0],
        "blobs": {facts[f][0]: [facts[f][1], facts[f][2]] for f in set(files)},
    }
    packed = msgpack.packb(body, use_bin_type=True)
    record = msgpack.packb({"body": packed, "sum": xxhash.xxh3_128_digest(packed)})
    rkey = xxhash.xxh3_128_hexdigest(packed)
    name = row.name if row.role == "session" else None
    chs = [r.chain for r in refs]
    block = int(msgpack.unpackb(row.manifest, raw=False)["block"])
    heads = boundary_heads([row.root, *chs], unpack_tokens(row.tokens), block)
    tier.put_record(namespace, rkey, record, name, chs, heads, bool(row.trimmable))
    return True


def pull(
    index: Index, blobs: BlobStore, tier: Tier, namespace: str, record: bytes, named: bool
) -> int:
    """Commit a record's snapshot into the local store (as a session if ``named``, else an
    anonymous prefix); CorruptBlobError if the record or a blob fails its checksum."""
    body = _body(record)
    keys = sorted(body["blobs"])
    salt = secrets.token_hex(6)
    index.begin_pending(salt)
    written: list[NewBlob] = []
    try:
        files: dict[str, str] = {}
        # a few blobs in memory at a time: fresh memory for a whole session costs more
        # than the network here, and a pull never holds more than PULL_AHEAD blobs
        for at in range(0, len(keys), PULL_AHEAD):
            got = tier.get_blobs(namespace, keys[at : at + PULL_AHEAD])
            for k, data in got.items():
                files[k] = _local(index, blobs, k, data, body["blobs"][k], salt, written)
            del got
        return _commit(index, namespace, body, files, written, salt, named)
    except BaseException:
        for b in written:
            blobs.delete(b.file)
        index.end_pending(salt)
        raise


def _body(record: bytes) -> dict[str, Any]:
    try:
        outer = msgpack.unpackb(record, raw=False)
        packed = outer["body"]
        if xxhash.xxh3_128_digest(packed) != outer["sum"]:
            raise ValueError("checksum")
        body: dict[str, Any] = msgpack.unpackb(packed, raw=False)
        assert body["v"] == 1 and isinstance(body["blobs"], dict)
        return body
    except Exception:
        raise CorruptBlobError("shared tier", "a damaged snapshot record") from None


def _local(
    index: Index,
    blobs: BlobStore,
    key: str,
    data: bytes | None,
    facts: list[Any],
    salt: str,
    written: list[NewBlob],
) -> str:
    """The local file of blob ``key``: one the store holds, or the tier's bytes, checked."""
    held = index.live_blob(key)
    if held is not None:
        return held[0]
    where = f"shared blob {key}"
    if data is None:
        raise EvictedError(where, "the shared tier no longer holds it")
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
    namespace: str,
    body: dict[str, Any],
    files: dict[str, str],
    written: list[NewBlob],
    salt: str,
    named: bool,
) -> int:
    r = dict(body["row"])
    refs = [BlockRef(i, bytes(c), files[k] if k else None) for i, c, k in body["blocks"]]
    now = time.time()
    row = {
        **r,
        "namespace": namespace,
        "name": r["name"] if named else None,
        "role": r["role"] if named else "prefix",
        "tail": files[body["tail"]],
        "bytes": sum(f[0] for f in body["blobs"].values()),
        "pinned": 0,
        "used": now,
    }
    with index.write() as db:
        writes.add_blobs(db, namespace, written)
        writes.finish_pending(db, salt)
        sid = writes.insert(db, row, refs)
        chs = [bytes(r["root"]), *(ref.chain for ref in refs)]
        block = int(msgpack.unpackb(r["manifest"], raw=False)["block"])
        writes.add_heads(db, sid, chs, unpack_tokens(r["tokens"]), block)
    return sid
