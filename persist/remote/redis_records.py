"""Records and pointers on a shared tier on a Redis-protocol server (key layout:
``redis_tier.py``): a record and the pointers to it in one pipeline, a named
snapshot's session pointer only over the value its pusher read (``pointer_swap``),
and every read bounded (``redis_reads``).  No mlx.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from . import redis_reads as reads
from .pointer_swap import POINTER_BYTES, SessionMoved, swap_redis
from .redis_base import RedisConnection

__all__ = ["RedisRecords", "MAX_VALUE"]

MAX_VALUE = 64 << 20  # a record read at most


class RedisRecords(RedisConnection):
    """What ``RedisTier`` does with records and pointers."""

    pointer_kinds = ("sess", "blk", "head")  # what put_record writes

    # -- records and pointers --------------------------------------------------

    def put_record(
        self,
        namespace: str,
        rkey: str,
        record: bytes,
        pointers: Sequence[tuple[str, bytes, bytes]],
        *,
        trimmable: bool = True,
        secret: bytes | None = None,
        replace: bool = True,  # a plain SET always (the cold tier's is write-once)
        replace_pointers: Collection[tuple[str, bytes]] = (),  # SET, never NX (sync)
        session: tuple[bytes, bytes, Any] | None = None,
    ) -> bytes | None:
        """The record (a plain SET: a wrong value there is replaced), its pointers (kind
        ``blk``/``head``, key, value) and, without an operator key, the namespace secret
        again (SET NX: an LRU that evicted it gets it back), read back in the same round
        trip: the tier's secret after (None with a key, or if it is no secret).  A
        trimmable snapshot's pointers replace older ones; an untrimmable one's
        (recurrent state: it serves only prompts that hold all its tokens) stay with
        the first, shortest snapshot that reached them (SET NX).  ``session``: (name,
        pointer value, token) of a named snapshot: its record first, then its pointer
        only over the value read (``swap_session``), else SessionMoved (a record this
        call created is deleted again), then the rest."""
        p = self.prefix(namespace)
        if session is None:
            out: bytes | None = self._call(
                "put record",
                lambda: self._put(
                    p,
                    rkey,
                    record,
                    pointers=pointers,
                    trimmable=trimmable,
                    secret=secret,
                    replace_pointers=replace_pointers,
                    ttl=self.ttl_s,
                ),
            )
            self._ok()
            return out

        def first() -> bool:  # the record before any pointer to it: True if it is new
            pipe = self._client.pipeline(transaction=False)
            # with a TTL until the pointer names it (a pusher that dies before leaves
            # nothing for good); one there already keeps its own (a durable one stays)
            pipe.set(f"{p}rec:{rkey}", record, ex=self.ttl_s, nx=True)
            pipe.set(f"{p}rec:{rkey}", record, keepttl=True)  # a wrong value replaced
            return bool(pipe.execute()[0])

        created = self._call("put record", first)
        name, value, token = session
        if not self._swap(namespace, name, value, token, f"{p}rec:{rkey}"):
            if created:  # nothing names it: not left behind
                self._call("put record", lambda: self._client.delete(f"{p}rec:{rkey}"))
            raise SessionMoved(f"session {name.decode(errors='replace')!r} moved on {self.url}")
        out = self._call(
            "put record",
            lambda: self._put(
                p,
                None,
                record,
                pointers=pointers,
                trimmable=trimmable,
                secret=secret,
                replace_pointers=replace_pointers,
                ttl=None,
            ),
        )
        self._ok()
        return out

    def _put(
        self,
        p: str,
        rkey: str | None,
        record: bytes,
        *,
        pointers: Sequence[tuple[str, bytes, bytes]],
        trimmable: bool,
        secret: bytes | None,
        replace_pointers: Collection[tuple[str, bytes]],
        ttl: int | None,
    ) -> bytes | None:
        """One pipeline: the record (unless ``rkey`` is None), the pointers, the secret."""
        pipe = self._client.pipeline(transaction=False)
        if rkey is not None:
            pipe.set(f"{p}rec:{rkey}", record, ex=ttl)
        for kind, key, value in pointers:
            once = not trimmable and (kind, key) not in replace_pointers
            pipe.set(reads.pointer_key(p, kind, key), value, ex=self.ttl_s, nx=once)
        if secret is not None:
            pipe.set(f"{p}secret", secret, nx=True)
            pipe.getrange(f"{p}secret", 0, reads.SECRET_BYTES)
        got = pipe.execute(raise_on_error=False)
        for v in got[:-1] if secret is not None else got:
            if isinstance(v, self._redis.ResponseError):
                raise v
        return reads.secret_value(self._reads.checked(got[-1])) if secret is not None else None

    def session_pointer(self, namespace: str, name: bytes) -> tuple[bytes | None, Any]:
        """The session pointer's value (None: none, or not one a reader reads) and the
        token ``swap_session`` compares: the value itself."""
        value = self.pointers(namespace, [("sess", name)])[0]
        return value, value

    def swap_session(self, namespace: str, name: bytes, value: bytes, token: Any) -> bool:
        """Set the session pointer to ``value`` if it still holds what ``session_pointer``
        read (``token``) or already ``value``; False if another push got there first."""
        key = reads.pointer_key(self.prefix(namespace), "sess", name)
        ok: bool = self._call(
            "swap session", lambda: swap_redis(self._redis, self._client, key, value, token)
        )
        self._ok()
        return ok

    def _swap(self, namespace: str, name: bytes, value: bytes, token: Any, record: str) -> bool:
        """``swap_session``, and the record it names made durable (its TTL removed): in
        the swap's transaction on one server; on a Cluster (the two keys are in two
        slots) right after it, where a pusher that dies between the two leaves a named
        record that expires with the TTL, written durable again by the next push or sync
        of it."""
        if self.cluster:
            if not self.swap_session(namespace, name, value, token):
                return False
            self._call("put record", lambda: self._client.persist(record))
            return True
        key = reads.pointer_key(self.prefix(namespace), "sess", name)
        ok: bool = self._call(
            "swap session",
            lambda: swap_redis(self._redis, self._client, key, value, token, durable=record),
        )
        self._ok()
        return ok

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
