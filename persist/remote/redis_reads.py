"""Bounded reads from a Redis-protocol server: no value costs a reader more than the
limit it names.  No mlx.

Whoever can write a namespace's keys can put a value of any size (up to 512 MB)
under any key a reader asks for, and GET or MGET read a value whole.  GETRANGE
``key 0 n`` reads at most n + 1 bytes, so a value longer than n is seen to be
too long without being read.  A lookup asks for hundreds of pointers at once:
on one server that is one EVALSHA of a script that GETRANGEs each key (one
command, about as cheap as the MGET it replaces, where a pipeline of GETRANGEs
costs ten times as much in redis-py); a pipeline where the keys span a
cluster's slots or scripts are refused (an ACL without ``+@scripting``).  A key
of another type reads as None, counted by the tier (``bad_values``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

from ..errors import CorruptBlobError

__all__ = [
    "SCRIPT", "Reader", "wrong_type", "scan", "parse_parts", "fetch_all", "blob_matches",
    "read_blob", "pointer_key", "secret_value", "SECRET_BYTES",
]  # fmt: skip

SECRET_BYTES = 32  # a namespace secret

# no-writes: allowed on a full server (maxmemory, noeviction) and on replicas (Redis 7,
# Valkey; an older server refuses the flag, and the pipeline serves instead); pcall: a
# key of another type is 0 (an integer), not an error that ends the script
SCRIPT = """#!lua flags=no-writes
local n = tonumber(ARGV[1])
local out = {}
for i, k in ipairs(KEYS) do
  local v = redis.pcall('GETRANGE', k, 0, n)
  if type(v) == 'table' then out[i] = 0 else out[i] = v end
end
return out
"""


def wrong_type(e: Exception) -> bool:
    return "WRONGTYPE" in str(e)


class Reader:
    """Bounded reads through one client (``client()`` gives it: a cluster connects late)."""

    def __init__(self, redis: Any, client: Any, cluster: bool, count: Any) -> None:
        self._redis, self._client, self.cluster, self._count = redis, client, cluster, count
        self._script: Any = None
        self.scripted = not cluster  # until the server refuses scripts

    def values(self, keys: Sequence[Any], most: int) -> list[bytes | None]:
        """Each key's value if it is a string of 1 to ``most`` bytes, else None (absent,
        empty, another type, or longer: counted as a bad value, never read whole)."""
        if not keys:
            return []
        raw = self._scripted(keys, most) if self.scripted else None
        if raw is None:
            raw = self._pipelined(keys, most)
        out: list[bytes | None] = []
        for v in raw:
            if isinstance(v, bytes) and len(v) > most:
                self._count("bad_values")
                v = None
            elif not isinstance(v, bytes):
                if v is not None:  # 0 from the script, an error from a pipeline
                    self._count("bad_values")
                v = None
            out.append(v or None)
        return out

    def _scripted(self, keys: Sequence[Any], most: int) -> list[Any] | None:
        client = self._client()
        if self._script is None:
            self._script = client.register_script(SCRIPT)
        try:
            return list(self._script(keys=list(keys), args=[most], client=client))
        except self._redis.ResponseError:
            # scripts refused (an ACL, a server without them), or a key this user may
            # not read: the pipeline tells which (it raises the latter again)
            got = self._pipelined(keys, most)
            self.scripted = False
            return got

    def _pipelined(self, keys: Sequence[Any], most: int) -> list[Any]:
        pipe = self._client().pipeline(transaction=False)
        for k in keys:
            pipe.getrange(k, 0, most)
        return [self.checked(v) for v in pipe.execute(raise_on_error=False)]

    def checked(self, v: Any) -> Any:
        """A pipeline's answer: a value, None for a key of another type, or the error
        raised (an ACL's refusal is the tier's to handle, not a bad value)."""
        if isinstance(v, self._redis.ResponseError):
            if not wrong_type(v):
                raise v
            return False  # counted by values()
        return v


def scan(client: Any, cluster: bool, match: str, count: int, rounds: int) -> list[Any]:
    """Keys matching ``match``, by at most ``rounds`` SCAN calls of ``count`` per node:
    stops at the first call that finds any (a bounded search, not a listing)."""
    found: list[Any] = []
    if cluster:  # every primary at once, then each node's cursor on
        cursors, keys = client.scan(0, match=match, count=count)
        found += keys
        for _ in range(rounds - 1):
            cursors = {n: c for n, c in cursors.items() if c}
            if found or not cursors:
                break
            for name, cur in list(cursors.items()):
                node = client.get_node(node_name=name)
                got, keys = client.scan(cur, match=match, count=count, target_nodes=node)
                cursors[name], found = got[name], found + keys
        return found
    cursor = 0
    for _ in range(rounds):
        cursor, keys = client.scan(cursor, match=match, count=count)
        found += keys
        if found or not cursor:
            break
    return found


def fetch_all(
    workers: int,
    keys: Sequence[str],
    fetch: Callable[[str], tuple[bytes, bytes] | None],
    then: Callable[[str, bytes, bytes], Any],
) -> dict[str, Any]:
    """``then(key, bytes, tag)`` of every blob ``fetch(key)`` gets, None where it gets
    none (the tier lacks it: nothing more is started).  ``workers`` threads fetch and
    as many run ``then`` (a tag's HMAC, for which hashlib lets go of the GIL, the
    checks, the local write), so one blob is checked while the next arrives; at most
    2 x ``workers`` blobs are in memory at once, never the whole session.  The first
    error is raised once the running ones end."""
    out: dict[str, Any] = {}
    room = threading.Semaphore(2 * workers)  # blobs fetched and not yet through ``then``

    with ThreadPoolExecutor(workers) as checks, ThreadPoolExecutor(workers) as fetches:

        def one(k: str) -> Future[Any] | None:
            room.acquire()
            try:
                got = fetch(k)
            except BaseException:
                room.release()
                raise
            if got is None:
                room.release()
                return None

            def check() -> Any:
                try:
                    return then(k, *got)
                finally:
                    room.release()

            return checks.submit(check)

        futures = {fetches.submit(one, k): k for k in keys}
        try:
            for f in as_completed(futures):
                checked = f.result()
                out[futures[f]] = None if checked is None else checked.result()
                if checked is None:
                    break
        finally:
            for f in futures:
                f.cancel()  # those not started; the pools wait for the running ones
    return out


def parse_parts(
    marker: Any, size: int, tag_bytes: int, where: str, part_bytes: int
) -> tuple[int, bytes]:
    """(part count, tag) of a ``parts:<n>[:<tag hex>]`` marker, checked against the
    record's size before any part is asked for."""
    try:
        fields = bytes(marker).decode("ascii").split(":")
        n, tag = int(fields[1]), bytes.fromhex(fields[2]) if len(fields) > 2 else b""
        ok = fields[0] == "parts" and len(fields) <= 3
    except (ValueError, IndexError, UnicodeDecodeError):
        ok = False
    if not ok or n != -(-size // part_bytes) or len(tag) != tag_bytes:
        raise CorruptBlobError(where, "a parts marker that disagrees with the record's size")
    return n, tag


def blob_matches(get: Any, key: str, data: bytes, tag: bytes | None, part_bytes: int) -> bool:
    """Does ``blob:<key>`` hold exactly what a push writes for ``data`` (its bytes and
    tag, or its parts marker and parts)?  ``get(k, n)`` reads at most n + 1 bytes."""
    whole = data + (tag or b"")
    if len(data) <= part_bytes:
        return bool(get(f"blob:{key}", len(whole)) == whole)
    n = -(-len(data) // part_bytes)
    marker = (f"parts:{n}" + (f":{tag.hex()}" if tag else "")).encode()
    if get(f"blob:{key}", len(marker)) != marker:
        return False
    for i in range(n):
        want = data[i * part_bytes : (i + 1) * part_bytes]
        if get(f"blob:{key}:{i}", len(want)) != want:
            return False
    return True


def read_blob(
    get: Any, k: str, size: int, tag_bytes: int, part_bytes: int
) -> tuple[bytes, bytes] | None:
    """(bytes, tag) of blob ``k`` of the record's ``size``, None where the tier lacks it
    (or part of it); ``get(k, n)`` reads at most n bytes.  CorruptBlobError for a value
    of another size or shape (a parts marker that disagrees is refused before the
    first part is asked for)."""
    where = f"shared blob {k}"
    if size <= part_bytes:  # the bytes, then the tag
        v = get(f"blob:{k}", size + tag_bytes)
        if not v:
            return None
        if len(v) != size + tag_bytes:
            raise CorruptBlobError(where, f"{len(v)} bytes where the record says {size}")
        return (v[:size] if tag_bytes else v), v[size:]
    marker = get(f"blob:{k}", 128)
    if not marker:
        return None
    n, tag = parse_parts(marker, size, tag_bytes, where, part_bytes)
    # one GET per part: redis-py parses large single replies faster than MGETs
    parts: list[Any] = []
    for i in range(n):
        want = min(part_bytes, size - i * part_bytes)
        got = get(f"blob:{k}:{i}", want)
        if not got:
            return None  # evicted
        if len(got) != want:
            raise CorruptBlobError(where, f"part {i} is {len(got)} bytes, not {want}")
        parts.append(got)
    return b"".join(parts), tag


def pointer_key(prefix: str, kind: str, key: bytes) -> bytes | str:
    """``sess:<name>`` (the name's UTF-8 bytes: Redis keys are binary), ``blk:<hex>``."""
    return f"{prefix}sess:".encode() + key if kind == "sess" else f"{prefix}{kind}:{key.hex()}"


def secret_value(v: Any) -> bytes | None:
    """A namespace secret read from a tier, or None (absent, another type, another length)."""
    return bytes(v) if isinstance(v, bytes) and len(v) == SECRET_BYTES else None
