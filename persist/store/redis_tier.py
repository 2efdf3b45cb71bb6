"""A shared tier on a Redis-protocol server (Redis, Valkey): blobs and snapshot records
that every machine of a fleet can read.  No mlx.

Keys live under one prefix per namespace, ``persist:<tag>:`` with ``tag`` the
first 16 hex digits of sha256(namespace), so a Redis ACL key pattern confines
a tenant.  Under it:

- ``secret``: the namespace's chain secret (the same on every machine);
- ``blob:<content key>``: a blob file's bytes, or ``parts:<n>`` and the parts
  ``blob:<key>:<i>`` of at most 8 MiB; written with SET NX (content-addressed,
  write-once) and a TTL unless the snapshot is pinned;
- ``rec:<record key>``: a snapshot record (msgpack, ``engine/tiers.py``);
- ``sess:<name>``: the record key of a named session;
- ``blk:<chain hex>``: the record key of a snapshot holding that block.

Every value read is checked by the caller (blob headers against the record's
checksums, records by their own checksum): a corrupt or evicted value is a
miss, never a wrong cache.  A server that is down costs one connect timeout,
then a breaker skips it for ``retry_after`` seconds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import InvalidArgumentError, PersistError

__all__ = ["RedisTier", "PART_BYTES", "TierUnavailable"]

log = logging.getLogger("persist")
PART_BYTES = 8 << 20  # values of at most 8 MiB
FETCHERS = 2  # blobs fetched at once (more only competes with the server for cores)
SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://")
CLUSTER_SCHEMES = tuple(s.replace("://", "+cluster://") for s in SCHEMES)


def namespace_tag(namespace: str) -> str:
    """A namespace's key prefix in every tier: an ACL or bucket policy can name it."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


class TierUnavailable(PersistError, ConnectionError):
    """The shared tier did not answer (down, timed out, or refused by its ACL)."""


class RedisTier:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None = 7 * 24 * 3600,
        connect_timeout_s: float = 1.0,
        retry_after_s: float = 10.0,
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
            self._client_ = redis.Redis.from_url(self.url, **timeouts)
        self.ttl_s, self.retry_after_s = ttl_s, retry_after_s
        self._down_until = 0.0
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- the breaker -------------------------------------------------------

    def _call(self, what: str, fn: Any) -> Any:
        if time.monotonic() < self._down_until:
            self._count("skipped")
            raise TierUnavailable(f"shared tier {self.url} is down (skipping it for a while)")
        try:
            return fn()
        except self._redis.exceptions.NoPermissionError as e:
            # an ACL confines this user to other namespaces: a refusal, not an outage
            self._count("denied")
            raise TierUnavailable(f"shared tier {self.url} refused {what}: {e}") from None
        except (self._redis.RedisError, self._redis.exceptions.RedisClusterException) as e:
            if self._down_until == 0.0:  # once per outage
                log.warning("persist: shared tier %s failed (%s): %s", self.url, what, e)
            self._down_until = time.monotonic() + self.retry_after_s
            self._count("errors")
            raise TierUnavailable(f"shared tier {self.url}: {what}: {e}") from None

    def _ok(self) -> None:
        self._down_until = 0.0

    @property
    def _client(self) -> Any:
        if self._client_ is None:  # a cluster: connected on first use, inside _call
            with self._lock:
                if self._client_ is None:
                    self._client_ = self._connect()
        return self._client_

    def _mget(self, keys: list[str]) -> list[Any]:
        """MGET; on a cluster, one pipelined MGET per node (keys of many slots)."""
        if self.cluster:
            return list(self._client.mget_nonatomic(keys))
        return list(self._client.mget(keys))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:  # blobs move on several threads
            self.counters[name] = self.counters.get(name, 0) + n

    @staticmethod
    def prefix(namespace: str) -> str:
        return f"persist:{namespace_tag(namespace)}:"

    # -- the namespace secret ------------------------------------------------

    def secret(self, namespace: str, mine: bytes) -> bytes:
        """The namespace's secret on the tier: ``mine`` if the tier had none."""
        key = self.prefix(namespace) + "secret"

        def run() -> bytes:
            self._client.set(key, mine, nx=True)
            got: Any = self._client.get(key)
            return bytes(got) if got is not None else mine

        out: bytes = self._call("secret", run)
        self._ok()
        return out

    def get_secret(self, namespace: str) -> bytes | None:
        """The namespace's secret if the tier has one (a read: nothing is created)."""
        key = self.prefix(namespace) + "secret"
        got: Any = self._call("secret", lambda: self._client.get(key))
        self._ok()
        return None if got is None else bytes(got)

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

    def put_blob(self, namespace: str, key: str, data: bytes, pinned: bool) -> None:
        p, ttl = self.prefix(namespace), None if pinned else self.ttl_s

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            if len(data) <= PART_BYTES:
                pipe.set(f"{p}blob:{key}", data, nx=True, ex=ttl)
            else:
                parts = range(0, len(data), PART_BYTES)
                for i, at in enumerate(parts):
                    pipe.set(f"{p}blob:{key}:{i}", data[at : at + PART_BYTES], ex=ttl)
                pipe.set(f"{p}blob:{key}", f"parts:{len(parts)}".encode(), nx=True, ex=ttl)
            pipe.execute()

        self._call("put blob", run)
        self._count("bytes_pushed", len(data))
        self._ok()

    def get_blobs(self, namespace: str, keys: Sequence[str]) -> dict[str, bytes | None]:
        """Each blob's bytes, or None where the tier lacks it (evicted, never written)."""
        p = self.prefix(namespace)

        def one(k: str) -> bytes | None:
            v: Any = self._client.get(f"{p}blob:{k}")
            if v is not None and v.startswith(b"parts:"):
                # one GET per part: redis-py parses large single replies faster than MGETs
                parts: Any = [self._client.get(f"{p}blob:{k}:{i}") for i in range(int(v[6:]))]
                v = None if any(x is None for x in parts) else b"".join(parts)
            return None if v is None else bytes(v)

        def run() -> dict[str, bytes | None]:
            with ThreadPoolExecutor(FETCHERS) as pool:  # connections from redis-py's pool
                return dict(zip(keys, pool.map(one, keys), strict=True))

        got: dict[str, bytes | None] = self._call("get blobs", run)
        self._count("bytes_pulled", sum(len(v) for v in got.values() if v))
        self._ok()
        return got

    # -- records and pointers --------------------------------------------------

    def put_record(
        self,
        namespace: str,
        rkey: str,
        record: bytes,
        name: str | None,
        chains: Sequence[bytes],
        heads: Sequence[bytes] = (),
        trimmable: bool = True,
    ) -> None:
        """The record and its pointers.  A trimmable snapshot serves any prefix of
        its own: its pointers replace older ones.  An untrimmable one (recurrent
        state) serves only prompts that hold all its tokens, so the pointers stay
        with the first, shortest snapshot that reached them (a prime saves its
        checkpoints in order), and a longer one never hides it (SET NX)."""
        p, nx = self.prefix(namespace), not trimmable

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(f"{p}rec:{rkey}", record, ex=self.ttl_s if name is None else None)
            if name is not None:
                pipe.set(f"{p}sess:{name}", rkey.encode())
            for c in chains:
                pipe.set(f"{p}blk:{c.hex()}", rkey.encode(), ex=self.ttl_s, nx=nx)
            for h in heads:
                pipe.set(f"{p}head:{h.hex()}", rkey.encode(), ex=self.ttl_s, nx=nx)
            pipe.execute()

        self._call("put record", run)
        self._ok()

    def session_record(self, namespace: str, name: str) -> bytes | None:
        p = self.prefix(namespace)

        def run() -> bytes | None:
            rkey: Any = self._client.get(f"{p}sess:{name}")
            if rkey is None:
                return None
            record: Any = self._client.get(f"{p}rec:{rkey.decode()}")
            return None if record is None else bytes(record)

        out: bytes | None = self._call("get session", run)
        self._ok()
        return out

    def deepest_chain(
        self, namespace: str, chains: Sequence[bytes], heads: Sequence[bytes] = ()
    ) -> list[bytes]:
        """Records of the deepest snapshots of the prompt the tier knows, deepest
        first, in two round trips: one MGET of every pointer, one pipelined GET of
        at most two records.  The candidates: the end of the longest run of the
        prompt's chains from the start (an LRU may drop a parent and keep its
        child: only the consecutive run counts), and the deepest head key
        (``heads[b]``: the prompt's 16 tokens after block boundary b, under chain
        b) at a boundary at least that deep.  The caller decides, from each
        record's tokens, which one serves the prompt."""
        p = self.prefix(namespace)
        keys = [f"{p}blk:{c.hex()}" for c in chains] + [f"{p}head:{h.hex()}" for h in heads]

        def run() -> list[bytes]:
            found: Any = self._mget(keys) if keys else []
            blk, hd = found[: len(chains)], found[len(chains) :]
            depth = 0
            while depth < len(blk) and blk[depth] is not None:
                depth += 1
            at = max((b for b, v in enumerate(hd) if v is not None), default=-1)
            rkeys = [hd[at]] if at >= depth else []
            if depth and blk[depth - 1] not in rkeys:
                rkeys.append(blk[depth - 1])
            if not rkeys:
                return []
            pipe = self._client.pipeline(transaction=False)
            for r in rkeys:
                pipe.get(f"{p}rec:{r.decode()}")
            return [bytes(v) for v in pipe.execute() if v is not None]

        out: list[bytes] = self._call("lookup", run)
        self._ok()
        return out


def cluster_client(url: str, timeouts: dict[str, Any]) -> Any:
    """A RedisCluster from ``redis+cluster://[[user]:password@]host:port[,host:port...]``:
    any of the nodes is enough to learn the slot map; TLS with ``rediss+cluster``."""
    from urllib.parse import unquote

    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    scheme, rest = url.split("://", 1)
    auth, _, hosts = rest.rpartition("@")
    user, _, password = auth.partition(":") if auth else ("", "", "")
    nodes = []
    for h in hosts.rstrip("/").split(","):
        host, _, port = h.strip().rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"a cluster node is host:port, not {h!r} in {url!r}")
        nodes.append(ClusterNode(host, int(port)))
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(user) or None,
        password=unquote(password) or None,
        ssl=scheme.startswith("rediss"),
        retry=Retry(NoBackoff(), 1),  # an outage costs about one timeout, not ten
        **timeouts,
    )
