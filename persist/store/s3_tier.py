"""A durable cold tier on an S3-compatible object store (AWS S3, MinIO, Ceph, moto).  No mlx.

Named sessions' records and blobs go here, under ``<prefix>/persist/<tag>/`` with
the same names as the shared tier's keys (``redis_tier.py``): ``secret``,
``blob/<content key>`` (created with If-None-Match: write-once), ``rec/<key>``,
``sess/<name>``.  A machine with only this tier restores any named session;
prefix lookups are the shared tier's job (one object per chain would cost a
request each), so ``deepest_chain`` finds nothing here.  Endpoint, region and
credentials come from the standard variables (``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``;
``AWS_ALLOW_HTTP=true`` for a plain-http endpoint).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import InvalidArgumentError, PersistError
from .redis_tier import TierUnavailable, namespace_tag

__all__ = ["S3Tier"]

log = logging.getLogger("persist")


class S3Tier:
    def __init__(
        self, url: str, *, connect_timeout_s: float = 1.0, retry_after_s: float = 10.0
    ) -> None:
        if not url.startswith("s3://") or len(url) <= len("s3://"):
            raise InvalidArgumentError(f"a cold tier URL is s3://bucket[/prefix]: {url!r}")
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise PersistError(
                'a cold tier needs obstore: pip install "mlx-persist[shared]"'
            ) from None
        bucket, _, prefix = url[len("s3://") :].partition("/")
        self.url, self._obstore = url, obstore
        options: Any = {
            "connect_timeout": f"{connect_timeout_s}s",
            "timeout": f"{4 * connect_timeout_s}s",
        }
        if os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":
            options["allow_http"] = True  # explicit client options shadow the variable
        # a server that is down costs about one timeout, not the client's default retries
        retry: Any = {"max_retries": 1, "retry_timeout": datetime.timedelta(seconds=2)}
        self._store = S3Store(bucket, client_options=options, retry_config=retry)
        self._root = "/".join(p for p in (prefix.strip("/"), "persist") if p)
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, namespace: str, *parts: str) -> str:
        return "/".join([self._root, namespace_tag(namespace), *parts])

    def _call(self, what: str, fn: Any) -> Any:
        if time.monotonic() < self._down_until:
            self.counters["skipped"] = self.counters.get("skipped", 0) + 1
            raise TierUnavailable(f"cold tier {self.url} is down (skipping it for a while)")
        ex = self._obstore.exceptions
        try:
            out = fn()
        except (ex.NotFoundError, FileNotFoundError):
            return None
        except (ex.PermissionDeniedError, ex.UnauthenticatedError) as e:
            self.counters["denied"] = self.counters.get("denied", 0) + 1
            raise TierUnavailable(f"cold tier {self.url} refused {what}: {e}") from None
        except Exception as e:  # network, timeouts, a 5xx: an outage
            if self._down_until == 0.0:
                log.warning("persist: cold tier %s failed (%s): %s", self.url, what, e)
            self._down_until = time.monotonic() + self.retry_after_s
            self.counters["errors"] = self.counters.get("errors", 0) + 1
            raise TierUnavailable(f"cold tier {self.url}: {what}: {e}") from None
        self._down_until = 0.0
        return out

    def _get(self, path: str) -> bytes | None:
        got = self._call("get", lambda: bytes(self._obstore.get(self._store, path).bytes()))
        return None if got is None else bytes(got)

    def _create(self, path: str, data: bytes) -> None:
        """Put ``data`` unless the object exists (If-None-Match: the first writer wins)."""

        def run() -> None:
            ex = self._obstore.exceptions
            with contextlib.suppress(ex.AlreadyExistsError, ex.PreconditionError):
                self._obstore.put(self._store, path, data, mode="create")

        self._call("put", run)

    # -- the interface the engine uses (the shared tier's) -------------------

    def get_secret(self, namespace: str) -> bytes | None:
        return self._get(self._path(namespace, "secret"))

    def secret(self, namespace: str, mine: bytes) -> bytes:
        self._create(self._path(namespace, "secret"), mine)
        return self.get_secret(namespace) or mine

    def missing_blobs(self, namespace: str, keys: Sequence[str]) -> list[str]:
        def exists(k: str) -> bool:
            head = self._call(
                "head", lambda: self._obstore.head(self._store, self._path(namespace, "blob", k))
            )
            return head is not None

        return [k for k in keys if not exists(k)]

    def put_blob(self, namespace: str, key: str, data: bytes, pinned: bool) -> None:
        self._create(self._path(namespace, "blob", key), data)
        with self._lock:  # blobs move on several threads
            self.counters["bytes_pushed"] = self.counters.get("bytes_pushed", 0) + len(data)

    def get_blobs(self, namespace: str, keys: Sequence[str]) -> dict[str, bytes | None]:
        with ThreadPoolExecutor(4) as pool:
            got = pool.map(lambda k: self._get(self._path(namespace, "blob", k)), keys)
            out = dict(zip(keys, got, strict=True))
        self.counters["bytes_pulled"] = self.counters.get("bytes_pulled", 0) + sum(
            len(v) for v in out.values() if v
        )
        return out

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
        if name is None:
            return  # the cold tier keeps named sessions
        self._create(self._path(namespace, "rec", rkey), record)
        path = self._path(namespace, "sess", name)
        self._call("put", lambda: self._obstore.put(self._store, path, rkey.encode()))

    def session_record(self, namespace: str, name: str) -> bytes | None:
        rkey = self._get(self._path(namespace, "sess", name))
        return None if rkey is None else self._get(self._path(namespace, "rec", rkey.decode()))

    def deepest_chain(
        self, namespace: str, chains: Sequence[bytes], heads: Sequence[bytes] = ()
    ) -> list[bytes]:
        return []
