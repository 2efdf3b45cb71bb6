"""Snapshots between the local store and a shared tier: push after a commit, pull on a miss.

A snapshot travels as a *record* (its index row, its block list by content
key, each blob's size and header checksum, bound to its namespace and name and
sealed by ``tier_records``) plus its blobs.  Pulling writes the blobs into the
local store, checked against the record before anything is committed, then
commits the row exactly as a local save would; from then on the local store
serves it.  A tier that fails never fails the local operation: the caller
counts it and goes on.  A value that is not what its key claims is a miss,
counted by why (``<tier>_malformed``, ``_mismatched``, ``_unauthenticated``).
"""

from __future__ import annotations

import io
import logging
import secrets
import sqlite3
import time
from typing import Any

from ..errors import CorruptBlobError
from ..format.tokens import unpack_tokens
from ..store import writes
from ..store.blobs import BlobStore
from ..store.chains import boundary_heads, chain_root, chains
from ..store.check import verify_blob
from ..store.index import Index
from ..store.redis_tier import RedisTier, TierUnavailable, namespace_tag
from ..store.rows import BlockRef, NewBlob
from ..store.s3_tier import S3Tier
from .costs import LOCAL, CostModel
from .tier_push import namespace_secret, push, sync
from .tier_records import (
    ROW_FIELDS,
    TAG_BYTES,
    BadValue,
    Expect,
    Keys,
    best_record,
    block_of,
    check_key,
    open_record,
    tier_key_from_env,
)

__all__ = ["Shared", "push", "pull", "sync", "EvictedError", "open_tiers"]


class EvictedError(CorruptBlobError):
    """A value the tier dropped (an LRU may drop anything): a miss, not damage."""


log = logging.getLogger("persist")
Tier = RedisTier | S3Tier
PULL_AHEAD = 4  # blobs fetched (in parallel) before they are written locally
ASK_AGAIN_S = 10.0  # a namespace no tier had a secret for is looked for again after this


class Shared:
    """A Store's shared tier: which namespaces agree with it, and the operations that
    never fail the local one (a tier that is down or refuses is counted and skipped)."""

    def __init__(
        self, tier: Tier, name: str = "shared", keys: Keys | None = None, backup: Tier | None = None
    ) -> None:
        self.tier, self.name = tier, name  # name: the prefix of its counters in persist stats
        self.keys = keys if keys is not None else Keys()
        self.backup = backup  # the cold tier, where a secret the shared one lost is kept
        self._agreed: dict[str, bytes] = {}
        self._none_until: dict[str, float] = {}
        self.unreachable = 0  # operations the tier was down for (sync tells a miss from these)

    def _count(self, index: Index, namespace: str, what: str) -> None:
        index.count(namespace, **{f"{self.name}_{what}": 1})

    def _bad(self, index: Index, namespace: str, e: BadValue) -> None:
        self._count(index, namespace, e.why)
        log.info("persist: %s tier value refused: %s", self.name, e.detail)

    def agree(self, index: Index, namespace: str, create: bool = False) -> bool:
        """Does this namespace's secret agree with the fleet's?  Only a save (``create``)
        puts a secret on the tier: a read never creates a namespace anywhere."""
        return self.secret(index, namespace, create) is not None

    def secret(self, index: Index, namespace: str, create: bool = False) -> bytes | None:
        """The namespace's chain secret, the fleet's (None: not shared, or none yet)."""
        if namespace not in self._agreed:
            if not create and time.monotonic() < self._none_until.get(namespace, 0.0):
                return None  # nothing anywhere a moment ago: no scan on every lookup
            got = self._run(lambda: namespace_secret(self, index, namespace, create))
            if got is None or not got[1]:
                if got is None:
                    self._none_until[namespace] = time.monotonic() + ASK_AGAIN_S
                return None if got is None else got[0]  # asked again next time
            self._agreed[namespace] = got[0]
        return self._agreed[namespace]

    def _run(self, op: Any) -> Any:
        try:
            return op()
        except TierUnavailable:
            self.unreachable += 1
            return None

    def _bytes(self, index: Index, namespace: str, before: dict[str, int]) -> None:
        """Bytes this operation moved, into the store's counters (persist stats)."""
        for what in ("bytes_pushed", "bytes_pulled"):
            n = self.tier.counters.get(what, 0) - before.get(what, 0)
            if n:
                index.count(namespace, **{f"{self.name}_{what}": n})

    def push(self, index: Index, blobs: BlobStore, namespace: str, sid: int) -> str:
        """Push one committed snapshot: ``pushed``, ``present`` (the tier had all of it),
        ``skipped`` (not this tier's, or gone meanwhile) or ``failed``."""
        secret = self.secret(index, namespace, create=True)
        if secret is None:
            self._count(index, namespace, "errors")
            return "failed"
        before = dict(self.tier.counters)
        done = self._run(lambda: push(index, blobs, self.tier, self.keys, namespace, sid, secret))
        if done in ("pushed", None):
            self._count(index, namespace, "pushes" if done else "errors")
        self._bytes(index, namespace, before)
        return done or "failed"

    def pull_session(self, index: Index, blobs: BlobStore, namespace: str, name: str) -> bool:
        """A named session the local store lacks, from the tier (CorruptBlobError if a
        blob is damaged); False where the tier is down or has no good record of it."""
        secret = self.secret(index, namespace)
        found = self._run(lambda: self._named(index, namespace, name, secret))
        if found is None:
            self._count(index, namespace, "misses")
            return False
        body, secret = found
        before = dict(self.tier.counters)
        try:
            if secret is not None and index.secret(namespace) is None:
                index.set_secret(namespace, secret)  # recovered from the record itself
            if self._run(lambda: pull(index, blobs, self.tier, self.keys, namespace, body, True)):
                self._count(index, namespace, "hits")
                return True
            return False
        except EvictedError:  # the LRU took part of it: the session is not there
            self._count(index, namespace, "incomplete")
            return False
        except BadValue as e:
            self._bad(index, namespace, e)
            return False
        finally:
            self._bytes(index, namespace, before)

    def _named(
        self, index: Index, namespace: str, name: str, secret: bytes | None
    ) -> tuple[dict[str, Any], bytes | None] | None:
        """The checked record of session ``name`` and the secret its chains are under."""
        ptr = self.tier.pointers(namespace, [("sess", name.encode())])[0]
        if ptr is None:
            return None
        try:
            rkey = self.keys.open_pointer(namespace, "sess", name.encode(), ptr)
            value = self.tier.records(namespace, [rkey])[0]
            if value is None:
                return None
            if secret is None and index.secret(namespace) is None:  # a new machine
                bare = open_record(self.keys, value, Expect(namespace, rkey, name=name))
                secret = bare.get("secret")
            want = Expect(namespace, rkey, name=name, secret=secret or index.secret(namespace))
            return open_record(self.keys, value, want), secret
        except BadValue as e:
            self._bad(index, namespace, e)
            return None

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
        longer_than: int = 0,
    ) -> None:
        """Pull the tier's deepest snapshot of this prompt if it beats the local one
        and ``longer_than`` (what the host tier holds), and, with ``costs``, if
        pulling and restoring it beats a prefill."""
        from .reading import choose

        secret = self.secret(index, namespace)  # adopts the fleet's secret on a new machine
        if secret is None:
            return
        local = choose(index, toks, identity, namespace, block, set())
        every = chains(chain_root(secret, identity.digest), toks, block)
        heads = boundary_heads(every, toks, block)  # prefixes that end inside a block
        want = Expect(namespace, secret=secret, block=block, identity=identity.digest)
        bodies = self._run(lambda: self._deepest(index, namespace, every[1:], heads, want)) or []
        found = best_record(bodies, toks)
        if found is None or found[0] <= max(local[1] if local else 0, longer_than):
            self._count(index, namespace, "misses")
            return
        usable, body = found
        if not self._worth(costs, identity, namespace, body, usable, max_cost):
            return
        before = dict(self.tier.counters)
        try:
            t0 = time.perf_counter()
            if self._run(lambda: pull(index, blobs, self.tier, self.keys, namespace, body, False)):
                self._count(index, namespace, "hits")
                moved = self.tier.counters.get("bytes_pulled", 0) - before.get("bytes_pulled", 0)
                if costs is not None:
                    costs.restored(identity, self.name, moved, time.perf_counter() - t0)
        except EvictedError:  # a shorter hit or none, never an error
            self._count(index, namespace, "incomplete")
        except BadValue as e:
            self._bad(index, namespace, e)
        except CorruptBlobError as e:  # never a wrong cache: the local answer stands
            self._count(index, namespace, "corrupt_skipped")
            log.warning("persist: skipping a damaged shared snapshot: %s", e)
        self._bytes(index, namespace, before)

    def _deepest(
        self, index: Index, namespace: str, chs: list[bytes], heads: list[bytes], want: Expect
    ) -> list[dict[str, Any]]:
        """Checked records of the deepest snapshots of the prompt the tier knows, in two
        round trips: one MGET of every pointer, one pipelined GET of at most two records.
        The candidates: the end of the longest run of the prompt's chains from the start
        (an LRU may drop a parent and keep its child: only the consecutive run counts),
        and the deepest head key (``heads[b]``: the prompt's 16 tokens after block
        boundary b, under chain b) at a boundary at least that deep."""
        items = [("blk", c) for c in chs] + [("head", h) for h in heads]
        found = self.tier.pointers(namespace, items) if items else []
        blk, hd = found[: len(chs)], found[len(chs) :]
        depth = 0
        while depth < len(blk) and blk[depth] is not None:
            depth += 1
        at = max((b for b, v in enumerate(hd) if v is not None), default=-1)
        followed = [("head", heads[at], hd[at])] if at >= depth else []
        if depth:
            followed.append(("blk", chs[depth - 1], blk[depth - 1]))
        rkeys: list[tuple[str, tuple[str, bytes]]] = []
        for kind, key, value in followed:
            try:
                rkeys.append((self.keys.open_pointer(namespace, kind, key, value), (kind, key)))
            except BadValue as e:
                self._bad(index, namespace, e)
        out = []
        values = self.tier.records(namespace, [r for r, _ in rkeys])
        for (rkey, via), value in zip(rkeys, values, strict=True):
            if value is None:
                continue
            try:
                want.rkey, want.via = rkey, via
                out.append(open_record(self.keys, value, want))
            except BadValue as e:
                self._bad(index, namespace, e)
        return out

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


def open_tiers(
    shared: str | None, cold: str | None, tier_key: bytes | None = None
) -> tuple[Shared | None, Shared | None]:
    """The shared (Redis) and cold (S3) tiers of these URLs (None where not given), and
    the operator key (``tier_key``, else ``$PERSIST_TIER_KEY``) that authenticates them."""
    keys = Keys(check_key(tier_key) if tier_key is not None else tier_key_from_env())
    c = Shared(S3Tier(cold), "cold", keys) if cold else None
    s = Shared(RedisTier(shared), "shared", keys, c.tier if c else None) if shared else None
    return s, c


def pull(
    index: Index,
    blobs: BlobStore,
    tier: Tier,
    keys: Keys,
    namespace: str,
    body: dict[str, Any],
    named: bool,
) -> int:
    """Commit a checked record's snapshot into the local store (as a session if
    ``named``, else an anonymous prefix); CorruptBlobError if a blob fails its checks.
    Blobs this store holds are not fetched; the others a few at a time."""
    facts = body["blobs"]
    files = {k: held[0] for k in facts if (held := index.live_blob(k)) is not None}
    keys_needed = sorted(k for k in facts if k not in files)
    salt = secrets.token_hex(6)
    index.begin_pending(salt)
    written: list[NewBlob] = []
    tag_bytes, where = TAG_BYTES if keys.key is not None else 0, namespace_tag(namespace).encode()

    def check(k: str, data: bytes, tag: bytes) -> None:  # the tag, on the fetching thread
        keys.check(b"blob", tag, where, k.encode(), data)

    try:
        # a few blobs in memory at a time: fresh memory for a whole session costs more
        # than the network here, and a pull never holds more than PULL_AHEAD blobs
        for at in range(0, len(keys_needed), PULL_AHEAD):
            chunk = {k: int(facts[k][0]) for k in keys_needed[at : at + PULL_AHEAD]}
            got = tier.get_blobs(namespace, chunk, tag_bytes, check)
            for k, value in got.items():
                files[k] = _local(blobs, k, value, facts[k], salt, written)
            del got
        return _commit(index, namespace, body, files, written, salt, named)
    except BaseException:
        for b in written:
            blobs.delete(b.file)
        index.end_pending(salt)
        raise


def _local(
    blobs: BlobStore,
    key: str,
    value: tuple[bytes, bytes] | None,
    facts: list[Any],
    salt: str,
    written: list[NewBlob],
) -> str:
    """The local file of blob ``key`` from the tier's bytes, checked (its tag, its size,
    its header against the record, every tensor against its checksum)."""
    where = f"shared blob {key}"
    if value is None:
        raise EvictedError(where, "the shared tier no longer holds it")
    data = value[0]  # its tag was checked as it arrived (pull's check)
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
    r = {k: body["row"][k] for k in ROW_FIELDS}
    refs = [BlockRef(i, bytes(c), files[k] if k else None) for i, c, k in body["blocks"]]
    row = {
        **r,
        "namespace": namespace,
        "name": r["name"] if named else None,
        "owner": r["owner"] if named else None,
        "role": r["role"] if named else "prefix",
        "trimmable": int(bool(r["trimmable"])),
        "tail": files[body["tail"]],
        "bytes": sum(f[0] for f in body["blobs"].values()),
        "pinned": 0,
        "used": time.time(),
    }
    try:
        with index.write() as db:
            writes.add_blobs(db, namespace, written)
            writes.finish_pending(db, salt)
            sid = writes.insert(db, row, refs)
            chs = [bytes(r["root"]), *(ref.chain for ref in refs)]
            writes.add_heads(db, sid, chs, unpack_tokens(r["tokens"]), block_of(body))
    except sqlite3.IntegrityError:  # the name was taken meanwhile (another pull, a save)
        raise BadValue("conflict", "the local store took that name meanwhile") from None
    return sid
