"""The connection to a shared tier on a Redis-protocol server: its URL, its client (one
server or a Cluster), and the breaker every operation runs behind (``_call``): a
server that is down costs one connect timeout, then is skipped for ``retry_after``
seconds; an answer about one key (another type, out of memory, an ACL) fails that
operation only.  ``redis_tier.RedisTier`` builds on it.  No mlx.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlparse

from ..errors import InvalidArgumentError, PersistError
from .blob_marks import BlobMarks
from .redis_cluster import cluster_client
from .redis_reads import Reader
from .refusals import Refusals
from .urls import scrubbed, shown_url

__all__ = ["RedisConnection", "TierUnavailable", "namespace_tag", "SCHEMES", "CLUSTER_SCHEMES"]

log = logging.getLogger("persist")
SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://")
CLUSTER_SCHEMES = tuple(s.replace("://", "+cluster://") for s in SCHEMES)


def namespace_tag(namespace: str) -> str:
    """A namespace's key prefix in every tier: an ACL or bucket policy can name it."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


class TierUnavailable(PersistError, ConnectionError):
    """The shared tier did not answer (down, timed out, or refused by its ACL)."""

    denied = False  # an ACL's refusal: an answer (not this user's), not an outage


class RedisConnection:
    """A Redis-protocol client behind a breaker: ``_call`` runs one operation, turning
    the server's failures into TierUnavailable; ``prefix`` is a namespace's keys."""

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
                f"a shared tier URL starts with {' or '.join(SCHEMES + CLUSTER_SCHEMES)}: "
                f"{shown_url(url)!r}"
            )
        try:
            import redis
            import redis.cluster
        except ImportError:
            raise PersistError(
                'a shared tier needs redis-py: pip install "mlx-persist[shared]"'
            ) from None
        given = url.replace("valkey", "redis", 1)
        self.url = shown_url(given)  # what messages show: never its password
        self._redis = redis
        self.cluster = given.startswith(CLUSTER_SCHEMES)
        timeouts: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": 2 * connect_timeout_s,
        }
        if self.cluster:  # the cluster's slot map is asked for on first use, not here
            self._client_: Any = None
            self._connect = lambda: cluster_client(given, timeouts)
        else:
            self._client_ = _from_url(redis, given, timeouts)
        self.ttl_s, self.retry_after_s, self.clock = ttl_s, retry_after_s, clock
        self._down_until = 0.0
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        self._reads = Reader(redis, lambda: self._client, self.cluster, self._count)
        self.marks = BlobMarks()
        self.refusals = Refusals(f"shared tier {self.url}")

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
            self.refusals.note(self.clock(), what, str(e))
            refused = TierUnavailable(f"shared tier {self.url} refused {what}: {e}")
            refused.denied = True
            raise refused from None
        except self._redis.ResponseError as e:
            if isinstance(e, self._redis.exceptions.ClusterError):
                raise self._outage(what, e) from None
            # the server answered (out of memory, a value of another type): this
            # operation failed, the server is not down
            self._count("errors")
            self.refusals.note(self.clock(), what, str(e))
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


def _from_url(redis: Any, url: str, timeouts: dict[str, Any]) -> Any:
    """redis-py's client of ``url``; a host, port or database it cannot read (a bad
    IPv6 address, a port out of range or not a number, port 0, a database that is not
    a number) is InvalidArgumentError."""
    try:
        _check_url(url)
        return redis.Redis.from_url(url, **timeouts)
    except ValueError as e:
        raise InvalidArgumentError(
            f"the shared tier URL {shown_url(url)!r} is not redis://host:port/db: "
            f"{scrubbed(str(e), url)}"
        ) from None


def _check_url(url: str) -> None:
    """ValueError for what redis-py takes but cannot mean: options in the query
    (unknown ones raised TypeError, ``decode_responses`` changed every value's type,
    ``socket_timeout`` lifted persist's stall bound), port 0 (every connection
    failed later), a database path that is not one number (``/x`` was database 0,
    ``/1/2`` database 12: it drops what it cannot read, and every slash)."""
    parts = urlparse(url)
    if parts.query or parts.params:  # redis-py makes each a client option, ours overridden
        names = sorted({q.partition("=")[0] for q in (parts.query or parts.params).split("&")})
        raise ValueError(
            f"options in the URL are not taken ({', '.join(n[:40] for n in names[:5])}): persist "
            "sets the client's timeouts and types itself; TLS is rediss://"
        )
    if parts.port == 0:  # .port raises ValueError itself past 65535 or for no number
        raise ValueError("port 0 is not a port (1 to 65535)")
    db = unquote(parts.path).removeprefix("/")
    if db and not re.fullmatch(r"[0-9]{1,9}", db):
        raise ValueError(f"the database {db[:40]!r} is not a number")
