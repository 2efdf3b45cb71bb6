"""A durable cold tier on an S3-compatible object store (AWS S3, MinIO, Ceph, moto).  No mlx.

Named sessions' records and blobs go here, under ``<prefix>/persist/<tag>/`` with
the same names as the shared tier's keys (``redis_tier.py``): ``secret``,
``blob/<content key>`` (created with If-None-Match; a taken one is read once per
process and a wrong value there replaced: ``blob_marks.py``), ``rec/<key>``,
``sess/<name>`` (the name percent-encoded into one segment: ``object_name``; put
only over the object its pusher read, If-Match its ETag: ``swap_session``).
A machine with only this tier restores any named session; prefix lookups are
the shared tier's job (one object per chain would cost a request each), so it
keeps no ``blk`` or ``head`` pointers.  An object is read only at the size
expected.  The breaker opens on the server's failures, never on its answer
about one key.  Endpoint, region and credentials come from the standard
variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``; ``AWS_ALLOW_HTTP=true`` for a plain-http endpoint).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any
from urllib.parse import quote

from ..errors import InvalidArgumentError, PersistError
from .blob_marks import BlobMarks
from .pointer_swap import POINTER_BYTES, SessionMoved
from .redis_reads import SECRET_BYTES, fetch_all, secret_value
from .redis_tier import MAX_VALUE, RECOVER_BATCH, RECOVER_RECORDS, TierUnavailable, namespace_tag
from .refusals import Refusals

__all__ = ["S3Tier"]

log = logging.getLogger("persist")
FETCHERS = 4  # objects fetched at once (each a request: latency, not the CPU, bounds them)


def brief(e: BaseException) -> str:
    """An object store error in one line: obstore's text goes on with a ~40-line
    "Debug source:" dump of its internal structures after the first line."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return (first or type(e).__name__)[:300]


class S3Tier:
    pointer_kinds = ("sess",)  # the cold tier keeps named sessions only
    named_only = True  # named sessions only: prefix lookups are the shared tier's job

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 1.0,
        retry_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
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
        self.refusals = Refusals(f"cold tier {url}")
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
        self.retry_after_s, self.clock = retry_after_s, clock
        self._down_until = 0.0
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        self.marks = BlobMarks()
        self._ignores: str | None = None  # the condition the server ignores (probed)
        self._probed = False

    def _path(self, namespace: str, *parts: str) -> str:
        return "/".join([self._root, namespace_tag(namespace), *parts])

    def _call(self, what: str, fn: Any) -> Any:
        if self.clock() < self._down_until:
            self._count("skipped")
            raise TierUnavailable(f"cold tier {self.url} is down (skipping it for a while)")
        ex = self._obstore.exceptions
        try:
            out = fn()
        except (ex.NotFoundError, FileNotFoundError):
            return None
        except (ex.PermissionDeniedError, ex.UnauthenticatedError) as e:
            self._count("denied")
            self.refusals.note(self.clock(), what, brief(e))
            raise TierUnavailable(f"cold tier {self.url} refused {what}: {brief(e)}") from None
        except Exception as e:
            if not _outage(e):  # the server answered about this one key: no breaker
                self._count("refused")
                self.refusals.note(self.clock(), what, brief(e))
                raise TierUnavailable(f"cold tier {self.url} refused {what}: {brief(e)}") from None
            if self._down_until == 0.0:  # network, timeouts, a 5xx: an outage
                log.warning("persist: cold tier %s failed (%s): %s", self.url, what, brief(e))
            self._down_until = self.clock() + self.retry_after_s
            self._count("errors")
            raise TierUnavailable(f"cold tier {self.url}: {what}: {brief(e)}") from None
        self._down_until = 0.0
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:  # blobs move on several threads
            self.counters[name] = self.counters.get(name, 0) + n

    def _get(self, path: str, size: int | None = None, most: int = MAX_VALUE) -> bytes | None:
        """An object's bytes; with ``size`` only an object of exactly that size, else at
        most ``most`` bytes (the size is known before the body is read)."""

        def run() -> bytes | None:
            got = self._obstore.get(self._store, path)
            n = int(got.meta["size"])
            if (size is not None and n != size) or n > most:
                self._count("bad_values")
                return None
            return bytes(got.bytes())

        out: bytes | None = self._call("get", run)
        return out

    def _conditions(self, beside: str) -> None:
        """Before the first write (beside ``path``, in its namespace's folder, where a
        tenant's credentials may write): does the server honour If-None-Match and
        If-Match on PUT?  A probe object is created, created again (must fail), put If-Match a
        wrong ETag (must fail), then deleted.  A server that ignores either would let
        every compare-and-set win (machines replace each other's sessions, a tombstone
        is overwritten): every write is refused (TierUnavailable), logged loudly once."""
        if not self._probed:
            tag = beside.removeprefix(self._root + "/").partition("/")[0]  # its namespace's
            path = "/".join([self._root, tag, "probe", os.urandom(8).hex()])
            ex, put = self._obstore.exceptions, self._obstore.put

            def refused(mode: Any) -> bool:
                try:
                    put(self._store, path, b"persist probe", mode=mode)
                except (ex.AlreadyExistsError, ex.PreconditionError):
                    return True
                return False

            def run() -> str | None:
                put(self._store, path, b"persist probe", mode="create")
                try:
                    if not refused("create"):
                        return "If-None-Match"
                    if not refused({"e_tag": '"0"'}):
                        return "If-Match"
                    return None
                finally:
                    self._obstore.delete(self._store, path)

            self._ignores = self._call("probe", run)
            self._probed = True  # after an answer: an outage probes again next time
            if self._ignores is not None:
                log.error(
                    "persist: cold tier %s ignores %s on PUT: persist will not write to it "
                    "(compare-and-set would always win and machines would replace each "
                    "other's sessions); use a server that honours If-Match and "
                    "If-None-Match (AWS S3, MinIO, Ceph RGW)", self.url, self._ignores,
                )  # fmt: skip
        if self._ignores is not None:
            self._count("refused")
            raise TierUnavailable(
                f"cold tier {self.url} ignores {self._ignores} on PUT; nothing is written to it"
            )

    def _create(self, path: str, data: bytes, replace: bool = False) -> bool:
        """Put ``data`` unless the object exists (If-None-Match: the first writer wins),
        or unconditionally with ``replace`` (what is there failed its check); written?"""
        self._conditions(path)

        def run() -> bool:
            ex = self._obstore.exceptions
            if replace:
                self._obstore.put(self._store, path, data)
                return True
            with contextlib.suppress(ex.AlreadyExistsError, ex.PreconditionError):
                self._obstore.put(self._store, path, data, mode="create")
                return True
            return False

        return bool(self._call("put", run))

    # -- the interface the engine uses (the shared tier's) -------------------

    def get_secret(self, namespace: str) -> bytes | None:
        """The namespace's secret, or None (absent, or an object that is no secret)."""
        got = self._get(self._path(namespace, "secret"), most=SECRET_BYTES)
        if got is not None and secret_value(got) is None:
            self._count("bad_values")
        return secret_value(got)

    def secret(self, namespace: str, mine: bytes) -> bytes:
        """The namespace's secret, ``mine`` if there was none (created write-once, then
        read back: the first writer's is the fleet's).  An object there that is no
        secret is persist's own gone bad: replaced by ``mine``."""
        path = self._path(namespace, "secret")
        held = self.get_secret(namespace)
        if held is not None:
            return held
        self._create(path, mine)
        held = self.get_secret(namespace)
        if held is None:  # something that is no secret is there
            self._call("put", lambda: self._obstore.put(self._store, path, mine))
            held = self.get_secret(namespace)
        return held or mine

    def recovery_records(self, namespace: str) -> Iterator[bytes]:
        """Records of the namespace (the first RECOVER_RECORDS of a listing, each read only
        if it is at most MAX_VALUE bytes): where a lost secret is recovered from."""

        def listed() -> list[str]:
            out: list[str] = []
            for batch in self._obstore.list(
                self._store, self._path(namespace, "rec") + "/", chunk_size=RECOVER_BATCH
            ):
                out += [str(meta["path"]) for meta in batch]
                if len(out) >= RECOVER_RECORDS:
                    break
            return out[:RECOVER_RECORDS]

        for path in self._call("list", listed) or []:
            value = self._get(path)
            if value:
                yield value

    def missing_blobs(self, namespace: str, keys: Sequence[str]) -> list[str]:
        def exists(k: str) -> bool:
            head = self._call(
                "head", lambda: self._obstore.head(self._store, self._path(namespace, "blob", k))
            )
            return head is not None

        return [k for k in keys if not exists(k)]

    def blob_matches(self, namespace: str, key: str, data: bytes, tag: bytes | None) -> bool:
        """Does the tier hold exactly what ``put_blob`` would write for this blob?"""
        whole = data + tag if tag else data
        return self._get(self._path(namespace, "blob", key), size=len(whole)) == whole

    def put_blob(
        self,
        namespace: str,
        key: str,
        data: bytes,
        pinned: bool,
        tag: bytes | None = None,
        replace: bool = False,
    ) -> None:
        """A blob's bytes, then the operator key's ``tag`` of them if there is a key;
        write-once unless ``replace`` (a value there failed ``blob_matches``)."""
        if self._create(self._path(namespace, "blob", key), data + tag if tag else data, replace):
            self.marks.good(namespace, key)
        self._count("bytes_pushed", len(data))

    def get_blobs(
        self, namespace: str, sizes: dict[str, int], tag_bytes: int, then: Any
    ) -> dict[str, Any]:
        """``then(key, bytes, tag)`` of each blob beside the next fetch (``fetch_all``),
        None where the tier lacks it (nothing more is fetched); an object whose size is
        not the record's is never read."""

        def one(k: str) -> tuple[bytes, bytes] | None:
            want = sizes[k] + tag_bytes
            v = self._get(self._path(namespace, "blob", k), size=want, most=want)
            if v is None:
                return None
            self._count("bytes_pulled", sizes[k])
            return (v[: sizes[k]], v[sizes[k] :]) if tag_bytes else (v, b"")

        return fetch_all(FETCHERS, list(sizes), one, then)

    def put_record(
        self,
        namespace: str,
        rkey: str,
        record: bytes,
        pointers: Sequence[tuple[str, bytes, bytes]],
        *,
        trimmable: bool = True,
        secret: bytes | None = None,
        replace: bool = False,
        replace_pointers: Collection[tuple[str, bytes]] = (),  # no blk/head pointers here
        session: tuple[bytes, bytes, Any] | None = None,
    ) -> bytes | None:
        """A named session's record (write-once unless ``replace``: what is there is not
        this record), then its ``sess/`` pointer only over the value read (``session``:
        name, pointer value, token; ``swap_session``), else SessionMoved (a record this
        call created is deleted again); then, without an operator key, the namespace
        secret if it has none; the tier's secret after (None with a key).  The cold
        tier keeps named sessions only: nothing else is written."""
        if session is None:
            return None
        path = self._path(namespace, "rec", rkey)
        created = self._create(path, record, replace)
        name, value, token = session
        if not self.swap_session(namespace, name, value, token):
            if created:  # nothing names it: not left behind
                self._call("delete", lambda: self._obstore.delete(self._store, path))
            raise SessionMoved(f"session {name.decode(errors='replace')!r} moved on {self.url}")
        return None if secret is None else self.secret(namespace, secret)

    def session_pointer(self, namespace: str, name: bytes) -> tuple[bytes | None, Any]:
        """The ``sess/`` pointer's value (None: none, or over 128 bytes) and its ETag, the
        token ``swap_session`` puts If-Match (None: no object, If-None-Match)."""
        path = self._path(namespace, "sess", object_name(name.decode()))

        def run() -> tuple[bytes | None, Any]:
            got = self._obstore.get(self._store, path)
            etag = got.meta.get("e_tag")
            if int(got.meta["size"]) > POINTER_BYTES:
                self._count("bad_values")
                return None, etag
            return bytes(got.bytes()) or None, etag

        out: tuple[bytes | None, Any] | None = self._call("get", run)
        return out if out is not None else (None, None)

    def swap_session(self, namespace: str, name: bytes, value: bytes, token: Any) -> bool:
        """Put the ``sess/`` pointer if it is still the object ``session_pointer`` read:
        a conditional PUT (If-Match its ETag, or If-None-Match where there was none);
        False if another push got there first."""
        path = self._path(namespace, "sess", object_name(name.decode()))
        self._conditions(path)
        mode: Any = "create" if token is None else {"e_tag": token}

        def run() -> bool:
            ex = self._obstore.exceptions
            try:
                self._obstore.put(self._store, path, value, mode=mode)
            except (ex.AlreadyExistsError, ex.PreconditionError):
                return False
            return True

        return bool(self._call("put", run))  # None: deleted since it was read (a 404)

    def pointers(self, namespace: str, items: Sequence[tuple[str, bytes]]) -> list[Any]:
        """``sess`` pointers by name; the cold tier keeps no ``blk`` or ``head`` ones."""
        return [
            self._get(self._path(namespace, "sess", object_name(k.decode())), most=POINTER_BYTES)
            if kind == "sess"
            else None
            for kind, k in items
        ]

    def has_record(self, namespace: str, rkey: str) -> bool:
        path = self._path(namespace, "rec", rkey)
        return self._call("head", lambda: self._obstore.head(self._store, path)) is not None

    def records(self, namespace: str, rkeys: Sequence[str]) -> list[bytes | None]:
        return [self._get(self._path(namespace, "rec", r)) for r in rkeys]


def object_name(name: str) -> str:
    """A session name as one object-key segment that every name round-trips through:
    percent-encoding of all but letters, digits, ``-`` and ``_`` (so ``/``, ``.``,
    ``..`` and empty segments cannot occur), or, past 512 bytes, ``=`` and its sha256
    (``=`` is always encoded otherwise; the record inside holds the name itself)."""
    encoded = quote(name, safe="-_").replace(".", "%2E").replace("~", "%7E")
    if len(encoded) <= 512:
        return encoded
    return "=" + hashlib.sha256(name.encode()).hexdigest()


def _outage(e: Exception) -> bool:
    """Is this a failure of the server (network, timeout, 5xx, throttling), rather than
    its answer about one key (a path it cannot take, a 4xx)?"""
    if isinstance(e, ValueError | TypeError) or type(e).__name__ == "InvalidPathError":
        return False  # refused before any request (a path the client cannot parse)
    found = re.search(r"status(?: code)?:? (\d{3})", str(e))
    return found is None or not found.group(1).startswith("4") or found.group(1) in ("408", "429")
