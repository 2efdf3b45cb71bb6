"""A shared tier on a Redis-protocol server (Redis, Valkey): blobs and snapshot records
that every machine of a fleet can read.  No mlx.

Keys live under one prefix per namespace, ``persist:<tag>:`` with ``tag`` the
first 16 hex digits of sha256(namespace), so a Redis ACL key pattern confines
a tenant.  Under it:

- ``secret``: the namespace's chain secret, when there is no operator key;
- ``block_tokens``: the namespace's block size, set by the first store that saved to
  it; a store that cuts other blocks refuses the tier (``engine/tiers/fleet_block``);
- ``blob:<content key>``: a blob file's bytes (and its tag), or ``parts:<n>[:<tag>]``
  and the parts ``blob:<key>:<i>`` of at most 8 MiB; written with SET NX
  (content-addressed) and a TTL unless the snapshot is pinned; a taken key is read
  once per process (``blob_marks.py``), and a wrong value there is overwritten (plain SET);
- ``rec:<record key>``: a snapshot record (``engine/tiers/records.py``);
- ``sess:<name>``, ``blk:<chain hex>``, ``head:<head key hex>``: pointers to records.

Nothing read here is trusted: the engine checks every value against what it asked
for (``engine/tiers/records.py``), and every read is bounded (GETRANGE,
``redis_reads.py``); a key of another type reads as nothing.  A server that is down
costs one connect timeout, then a breaker skips it for ``retry_after`` seconds; an
answer about one key (another type, out of memory, an ACL) fails that operation only.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from ..errors import CorruptBlobError, InvalidArgumentError, PersistError
from . import redis_reads as reads
from .blob_marks import BlobMarks
from .redis_cluster import cluster_client
from .redis_reads import Reader, blob_matches, fetch_all, read_blob, scan

__all__ = ["RedisTier", "PART_BYTES", "TierUnavailable", "cluster_client"]

log = logging.getLogger("persist")
PART_BYTES = 8 << 20  # values of at most 8 MiB
MAX_VALUE, POINTER_BYTES = 64 << 20, 128  # a record, a pointer (65 bytes) read at most
SCAN_COUNT, SCAN_ROUNDS = 1000, 8  # the bounded search for a record to recover a secret from
SCAN = (SCAN_COUNT, SCAN_ROUNDS)
RECOVER_RECORDS, RECOVER_BATCH = 256, 32  # records tried for a lost secret, read per round trip
BLOCK_DIGITS = 8  # a block size's decimal digits, at most (1 to 2**20 tokens)
FETCHERS = 2  # blobs fetched at once (more only competes with the server for cores)
SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://")
CLUSTER_SCHEMES = tuple(s.replace("://", "+cluster://") for s in SCHEMES)


def namespace_tag(namespace: str) -> str:
    """A namespace's key prefix in every tier: an ACL or bucket policy can name it."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


class TierUnavailable(PersistError, ConnectionError):
    """The shared tier did not answer (down, timed out, or refused by its ACL)."""

    denied = False  # an ACL's refusal: an answer (not this user's), not an outage


class RedisTier:
    pointer_kinds = ("sess", "blk", "head")  # what put_record writes

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None = 7 * 24 * 3600,
        connect_timeout_s: float = 1.0,
        retry_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not url.startswith(SCHEMES + CLUSTER_SCHEMES):
            raise InvalidArgumentError(
                f"a shared tier URL starts with {' or '.join(SCHEMES + CLUSTER_SCHEMES)}: {url!r}"
            )
        try:
            import redis
            import redis.cluster
        except ImportError:
            raise PersistError(
                'a shared tier needs redis-py: pip install "mlx-persist[shared]"'
            ) from None
        self.url = url.replace("valkey", "redis", 1)
        self._redis = redis
        self.cluster = self.url.startswith(CLUSTER_SCHEMES)
        timeouts: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": 2 * connect_timeout_s,
        }
        if self.cluster:  # the cluster's slot map is asked for on first use, not here
            self._client_: Any = None
            self._connect = lambda: cluster_client(self.url, timeouts)
        else:
            self._client_ = _from_url(redis, self.url, timeouts)
        self.ttl_s, self.retry_after_s, self.clock = ttl_s, retry_after_s, clock
        self._down_until = 0.0
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        self._reads = Reader(redis, lambda: self._client, self.cluster, self._count)
        self.marks = BlobMarks()

    # -- the breaker -------------------------------------------------------

    def _call(self, what: str, fn: Any) -> Any:
        if self.clock() < self._down_until:
            self._count("skipped")
            raise TierUnavailable(f"shared tier {self.url} is down (skipping it for a while)")
        try:
            return fn()
        except self._redis.exceptions.NoPermissionError as e:
            # an ACL confines this user to other namespaces: a refusal, not an outage
            self._count("denied")
            refused = TierUnavailable(f"shared tier {self.url} refused {what}: {e}")
            refused.denied = True
            raise refused from None
        except self._redis.ResponseError as e:
            if isinstance(e, self._redis.exceptions.ClusterError):
                raise self._outage(what, e) from None
            # the server answered (out of memory, a value of another type): this
            # operation failed, the server is not down
            self._count("errors")
            raise TierUnavailable(f"shared tier {self.url} refused {what}: {e}") from None
        except (self._redis.RedisError, self._redis.exceptions.RedisClusterException) as e:
            raise self._outage(what, e) from None

    def _outage(self, what: str, e: Exception) -> TierUnavailable:
        """The server is down or unreachable: skipped for ``retry_after_s``."""
        if self._down_until == 0.0:  # once per outage
            log.warning("persist: shared tier %s failed (%s): %s", self.url, what, e)
        self._down_until = self.clock() + self.retry_after_s
        self._count("errors")
        return TierUnavailable(f"shared tier {self.url}: {what}: {e}")

    def _ok(self) -> None:
        self._down_until = 0.0

    @property
    def _client(self) -> Any:
        if self._client_ is None:  # a cluster: connected on first use, inside _call
            with self._lock:
                if self._client_ is None:
                    self._client_ = self._connect()
        return self._client_

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:  # blobs move on several threads
            self.counters[name] = self.counters.get(name, 0) + n

    @staticmethod
    def prefix(namespace: str) -> str:
        return f"persist:{namespace_tag(namespace)}:"

    # -- the namespace secret ------------------------------------------------

    def secret(self, namespace: str, mine: bytes) -> bytes:
        """The namespace's secret on the tier, ``mine`` if it had none (SET NX, then read
        back: the tier's is the fleet's).  A value there that is no secret (another type,
        another length) is persist's own key gone bad: replaced by ``mine``."""
        key = self.prefix(namespace) + "secret"

        def run() -> bytes:
            for replace in (False, True):
                pipe = self._client.pipeline(transaction=False)
                if replace:
                    pipe.delete(key)
                pipe.set(key, mine, nx=True)
                pipe.getrange(key, 0, reads.SECRET_BYTES)
                got = reads.secret_value(
                    self._reads.checked(pipe.execute(raise_on_error=False)[-1])
                )
                if got is not None:
                    return got
                self._count("bad_values")
            return mine

        out: bytes = self._call("secret", run)
        self._ok()
        return out

    def get_secret(self, namespace: str) -> bytes | None:
        """The namespace's secret if the tier has one (a read: nothing is created); a
        value that is no secret reads as none (counted)."""
        key = self.prefix(namespace) + "secret"
        got = self._call("secret", lambda: self._reads.values([key], reads.SECRET_BYTES + 1)[0])
        self._ok()
        if got is not None and reads.secret_value(got) is None:
            self._count("bad_values")
        return reads.secret_value(got)

    # -- the fleet's block size ----------------------------------------------

    def block_tokens(self, namespace: str, mine: int, create: bool) -> int | None:
        """The namespace's block size on the tier (None: none, and not ``create``: a read
        creates nothing); ``create`` plants ``mine`` where there is none (SET NX, then
        read back: the first saver's is the fleet's).  A value that is no block size is
        persist's own key gone bad: replaced by ``mine``."""
        key = self.prefix(namespace) + "block_tokens"

        def run() -> int | None:
            if not create:
                return _block_size(self._reads.values([key], BLOCK_DIGITS)[0])
            for replace in (False, True):
                pipe = self._client.pipeline(transaction=False)
                if replace:
                    pipe.delete(key)
                pipe.set(key, str(mine), nx=True)
                pipe.getrange(key, 0, BLOCK_DIGITS)
                got = _block_size(self._reads.checked(pipe.execute(raise_on_error=False)[-1]))
                if got is not None:
                    return got
                self._count("bad_values")
            return mine

        out: int | None = self._call("block size", run)
        self._ok()
        return out

    def recovery_records(self, namespace: str) -> Iterator[bytes]:
        """Records of the namespace, found by a bounded SCAN (``SCAN_ROUNDS`` calls per
        node), where a lost secret is recovered from (records carry it): at most
        ``RECOVER_RECORDS`` of them, read a batch at a time, each at most MAX_VALUE
        bytes and no batch more (STRLEN first), so junk under ``rec:`` keys costs a
        bounded search, never a failed one while a good record is within reach."""
        match = f"{self.prefix(namespace)}rec:*"
        found = self._call("scan", lambda: scan(self._client, self.cluster, match, *SCAN))
        self._ok()
        for at in range(0, min(len(found), RECOVER_RECORDS), RECOVER_BATCH):
            keys = found[at : at + RECOVER_BATCH]
            sizes = self._call("strlen", lambda keys=keys: self._strlen(keys))
            batch: list[tuple[Any, int]] = []
            total = 0
            for k, n in zip(keys, sizes, strict=True):
                if isinstance(n, int) and 0 < n <= MAX_VALUE:
                    if total + n > MAX_VALUE and batch:
                        yield from self._read_records(batch)
                        batch, total = [], 0
                    batch.append((k, n))
                    total += n
            yield from self._read_records(batch)

    def _strlen(self, keys: Sequence[Any]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        return [self._reads.checked(v) for v in pipe.execute(raise_on_error=False)]

    def _read_records(self, batch: list[tuple[Any, int]]) -> list[bytes]:
        def run() -> list[bytes]:
            pipe = self._client.pipeline(transaction=False)
            for k, n in batch:
                pipe.getrange(k, 0, n - 1)
            got = [self._reads.checked(v) for v in pipe.execute(raise_on_error=False)]
            return [bytes(v) for v in got if isinstance(v, bytes) and v]

        out: list[bytes] = self._call("records", run) if batch else []
        return out

    # -- blobs ----------------------------------------------------------------

    def missing_blobs(self, namespace: str, keys: Sequence[str]) -> list[str]:
        p = self.prefix(namespace)

        def run() -> list[str]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(f"{p}blob:{k}")
            return [k for k, n in zip(keys, pipe.execute(), strict=True) if not n]

        out: list[str] = self._call("exists", run)
        self._ok()
        return out

    def blob_matches(self, namespace: str, key: str, data: bytes, tag: bytes | None) -> bool:
        """Does the tier hold exactly what ``put_blob`` would write for this blob?"""
        p = self.prefix(namespace)

        def get(k: str, n: int) -> Any:
            try:
                return self._bad(key, lambda: self._client.getrange(p + k, 0, n))
            except CorruptBlobError:
                return None  # a key of another type: not the blob

        got: bool = self._call("verify blob", lambda: blob_matches(get, key, data, tag, PART_BYTES))
        self._ok()
        return got

    def put_blob(
        self,
        namespace: str,
        key: str,
        data: bytes,
        pinned: bool,
        tag: bytes | None = None,
        replace: bool = False,
    ) -> None:
        """A blob's bytes (and the operator key's ``tag`` of them: after a small blob's
        bytes, in a large one's ``parts:<n>:<tag hex>`` marker); SET NX unless
        ``replace`` (a value there failed ``blob_matches``)."""
        p, ttl, nx = self.prefix(namespace), None if pinned else self.ttl_s, not replace

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            if len(data) <= PART_BYTES:
                pipe.set(f"{p}blob:{key}", data + (tag or b""), nx=nx, ex=ttl)
            else:
                parts = range(0, len(data), PART_BYTES)
                for i, at in enumerate(parts):
                    pipe.set(f"{p}blob:{key}:{i}", data[at : at + PART_BYTES], ex=ttl)
                marker = f"parts:{len(parts)}" + (f":{tag.hex()}" if tag else "")
                pipe.set(f"{p}blob:{key}", marker.encode(), nx=nx, ex=ttl)
            return pipe.execute()[-1]

        if self._call("put blob", run):  # written (an NX that found the key taken: not)
            self.marks.good(namespace, key)
        self._count("bytes_pushed", len(data))
        self._ok()

    def get_blobs(
        self, namespace: str, sizes: dict[str, int], tag_bytes: int, then: Any
    ) -> dict[str, Any]:
        """``then(key, bytes, tag)`` of each blob, on a thread of its own (its tag's HMAC,
        its checks and its local write beside the next fetch: ``fetch_all``), None where
        the tier lacks it (evicted, never written: nothing more is fetched).  ``sizes``
        are the record's: every read is bounded by them (``read_blob``)."""
        p = self.prefix(namespace)

        def one(k: str) -> tuple[bytes, bytes] | None:
            def get(key: str, n: int) -> Any:  # at most n bytes
                return self._bad(k, lambda: self._client.getrange(p + key, 0, n - 1))

            try:
                got = read_blob(get, k, sizes[k], tag_bytes, PART_BYTES)
            except CorruptBlobError:
                if not tag_bytes:
                    raise
                # with a key, a value of another size or shape carries no tag of it:
                # unauthenticated (the checking thread finds no tag), not damage
                return b"", b""
            if got is not None:
                self._count("bytes_pulled", sizes[k])
            return got

        # connections from redis-py's pool, one per fetching thread
        got: dict[str, Any] = self._call(
            "get blobs", lambda: fetch_all(FETCHERS, list(sizes), one, then)
        )
        self._ok()
        return got

    def _bad(self, k: str, fn: Any) -> Any:
        try:
            return fn()
        except self._redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            raise CorruptBlobError(f"shared blob {k}", "a key of another type") from None

    # -- records and pointers --------------------------------------------------

    def put_record(
        self,
        namespace: str,
        rkey: str,
        record: bytes,
        pointers: Sequence[tuple[str, bytes, bytes]],
        trimmable: bool = True,
        secret: bytes | None = None,
        replace: bool = True,  # a plain SET always (the cold tier's is write-once)
        replace_pointers: Collection[tuple[str, bytes]] = (),  # SET, never NX (sync)
    ) -> bytes | None:
        """The record (a plain SET: a wrong value there is replaced), its pointers (kind
        ``sess``/``blk``/``head``, key, value) and, without an operator key, the
        namespace secret again (SET NX: an LRU that evicted it gets it back), read back
        in the same round trip: the tier's secret after (None with a key, or if it is
        no secret).  A trimmable snapshot's pointers replace older ones; an
        untrimmable one's (recurrent state: it serves only prompts that hold all its
        tokens) stay with the first, shortest snapshot that reached them (SET NX)."""
        p, nx = self.prefix(namespace), not trimmable
        named = any(kind == "sess" for kind, _, _ in pointers)

        def run() -> bytes | None:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(f"{p}rec:{rkey}", record, ex=None if named else self.ttl_s)
            for kind, key, value in pointers:
                if kind == "sess":
                    pipe.set(reads.pointer_key(p, kind, key), value)
                else:
                    once = nx and (kind, key) not in replace_pointers
                    pipe.set(reads.pointer_key(p, kind, key), value, ex=self.ttl_s, nx=once)
            if secret is not None:
                pipe.set(f"{p}secret", secret, nx=True)
                pipe.getrange(f"{p}secret", 0, reads.SECRET_BYTES)
            got = pipe.execute(raise_on_error=False)
            for v in got[:-1] if secret is not None else got:
                if isinstance(v, self._redis.ResponseError):
                    raise v
            return reads.secret_value(self._reads.checked(got[-1])) if secret is not None else None

        out: bytes | None = self._call("put record", run)
        self._ok()
        return out

    def pointers(self, namespace: str, items: Sequence[tuple[str, bytes]]) -> list[Any]:
        """The values of pointers (``sess``: by name; ``blk``, ``head``: by hash), in one
        command, each read at most POINTER_BYTES far (a longer value, or a key of another
        type, reads as None)."""
        p = self.prefix(namespace)
        names = [reads.pointer_key(p, kind, k) for kind, k in items]
        out: list[Any] = self._call("pointers", lambda: self._reads.values(names, POINTER_BYTES))
        self._ok()
        return out

    def has_record(self, namespace: str, rkey: str) -> bool:
        key = f"{self.prefix(namespace)}rec:{rkey}"
        return bool(self._call("exists", lambda: self._client.exists(key)))

    def records(self, namespace: str, rkeys: Sequence[str]) -> list[bytes | None]:
        """Records by key, in one pipelined round trip, each read at most MAX_VALUE bytes."""
        p = self.prefix(namespace)

        def run() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for r in rkeys:
                pipe.getrange(f"{p}rec:{r}", 0, MAX_VALUE)
            got = [self._reads.checked(v) for v in pipe.execute(raise_on_error=False)]
            return [bytes(v) if isinstance(v, bytes) and v else None for v in got]

        out: list[bytes | None] = self._call("records", run)
        self._ok()
        return out


def _block_size(value: Any) -> int | None:
    """A block size as the tier holds it (decimal digits), or None."""
    if not isinstance(value, bytes) or not value.isdigit() or len(value) > BLOCK_DIGITS:
        return None
    n = int(value)
    return n if 1 <= n <= 1 << 20 else None


def _from_url(redis: Any, url: str, timeouts: dict[str, Any]) -> Any:
    """redis-py's client of ``url``; a host, port or database it cannot read (a bad
    IPv6 address, a port out of range or not a number, port 0, a database that is not
    a number) is InvalidArgumentError."""
    try:
        _check_url(url)
        return redis.Redis.from_url(url, **timeouts)
    except ValueError as e:
        raise InvalidArgumentError(
            f"the shared tier URL {url!r} is not redis://host:port/db: {e}"
        ) from None


def _check_url(url: str) -> None:
    """ValueError for what redis-py takes but cannot mean: port 0 (every connection
    failed later), a database path that is not one number (``/x`` was database 0,
    ``/1/2`` database 12: it drops what it cannot read, and every slash)."""
    parts = urlparse(url)
    if parts.port == 0:  # .port raises ValueError itself past 65535 or for no number
        raise ValueError("port 0 is not a port (1 to 65535)")
    db = unquote(parts.path).removeprefix("/")
    if db and not re.fullmatch(r"[0-9]{1,9}", db):
        raise ValueError(f"the database {db[:40]!r} is not a number")
