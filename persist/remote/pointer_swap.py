"""A session pointer written only over the value its writer read: a compare-and-set.  No mlx.

A push reads the tier's ``sess:<name>`` pointer, decides from the history it names
whether its snapshot may take the name (``engine/tiers/lineage.py``), then writes
the pointer.  Between the read and the write another machine may push: a plain
SET would replace that machine's turns without a word.  So the write names what
it read (its *token*) and fails if the pointer holds anything else; the pusher
reads again and decides again (``SessionMoved``), and the loser of a race is kept
beside the winner as ``NAME~N``, a conflict it reports.

- Redis (one server or a Cluster: the pointer is one key, so one slot): WATCH the
  key, read it as the reader reads it (``redis_reads``: at most ``POINTER_BYTES``,
  a key of another type is none), compare with the token, then MULTI/SET/EXEC
  (with PERSIST of the record it names, on one server: ``redis_records``),
  which fails if the key changed after the WATCH.  Transactions need no scripting
  (an ACL without ``+@scripting`` still shares).  The token is the value read.
- S3: a conditional PUT, ``If-Match`` the ETag read (or ``If-None-Match: *`` where
  there was none); the token is the ETag (``s3_tier.py``).
"""

from __future__ import annotations

from typing import Any

from ..errors import PersistError
from .redis_reads import wrong_type

__all__ = ["SessionMoved", "POINTER_BYTES", "swap_redis"]

POINTER_BYTES = 128  # a pointer (65 bytes) read at most (redis_tier's reads too)


class SessionMoved(PersistError, ConnectionError):
    """The tier's session pointer changed between a push's read and its write (another
    machine pushed): the pusher reads it again and decides again."""


def swap_redis(
    redis: Any, client: Any, key: Any, value: bytes, token: bytes | None, durable: Any = None
) -> bool:
    """SET ``key`` to ``value`` if it still holds ``token`` (None: none, as a reader sees
    it) or already ``value``; False if another value is there now.  ``durable``: a key
    (the record the pointer names, on one server only: one transaction is one slot)
    whose TTL goes in the same transaction, so it lasts exactly when it is named."""
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(key)
            try:
                held = pipe.getrange(key, 0, POINTER_BYTES)
            except redis.ResponseError as e:
                if not wrong_type(e):
                    raise
                held = None  # a key of another type reads as none (redis_reads)
            if not isinstance(held, bytes) or not 0 < len(held) <= POINTER_BYTES:
                held = None
            if held != value and held != token:
                return False
            pipe.multi()
            if held != value:
                pipe.set(key, value)
            if durable is not None:
                pipe.persist(durable)
            pipe.execute()
            return True
        except redis.WatchError:  # written between the WATCH and the EXEC
            return False
