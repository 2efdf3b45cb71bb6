"""Snapshot records on a tier: what a record binds, how the operator key authenticates
records, pointers and blobs, and how a value read from a tier is opened.

Anyone who can write a namespace's keys can write any value there, so nothing read
from a tier is trusted for what its key says: a record states the namespace tag,
the session name (or none), its tokens, identity digest, chains and blob keys, and
``open_record`` checks each against what the reader asked for and can recompute
(the chains from the tokens under the namespace secret).  With an operator key
(``PERSIST_TIER_KEY``) every record, pointer and blob also carries an HMAC-SHA256
tag, so only holders of the key can write a value a reader accepts.  Every check
that fails is ``BadValue``: a miss for that key, counted by ``why``, never an
untyped exception.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from ... import policy
from ...errors import CorruptBlobError, InvalidArgumentError
from ...format.tokens import common_prefix_packed, pack_tokens, unpack_tokens
from ...remote.redis_tier import namespace_tag
from ...servable import of_row
from ...storage.chains import HEAD_TOKENS, chain_root, head_key

__all__ = [
    "BadValue",
    "Keys",
    "Expect",
    "seal_record",
    "open_record",
    "tier_key_from_env",
    "best_record",
    "chains_under",
]

log = logging.getLogger("persist")
VERSION = 2
TAG_BYTES = 32  # HMAC-SHA256
MAX_RECORD = 64 << 20  # a record value past this is refused unread
MAX_BLOBS = 1 << 16
MAX_BLOB = 1 << 40
LIMITS = {"max_bin_len": MAX_RECORD, "max_str_len": 1 << 20, "max_array_len": 1 << 22}
LIMITS |= {"max_map_len": MAX_BLOBS}
KEY_ENV = "PERSIST_TIER_KEY"
ROW_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str, type(None)), "owner": (str, type(None)), "role": (str,),
    "identity": (str,), "identity_map": (bytes,), "root": (bytes,), "last_chain": (bytes,),
    "n_blocks": (int,), "n_tokens": (int,), "tokens": (bytes,), "trimmable": (bool, int),
    "min_resume": (int,), "manifest": (bytes,), "metadata": (bytes,), "created": (float, int),
}  # fmt: skip
ROW_FIELDS = tuple(ROW_TYPES)
ROLES = ("session", "prefix", "checkpoint")
_warned: list[bool] = []


class BadValue(CorruptBlobError):
    """A tier value that is not what its key claims: a miss for that key.  ``why`` is
    the counter it adds to (``malformed``, ``mismatched``, ``unauthenticated``)."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__("tier value", detail)
        self.why = why


def tier_key_from_env() -> bytes | None:
    """The operator key from ``PERSIST_TIER_KEY`` (hex), or None."""
    raw = os.environ.get(KEY_ENV, "").strip()
    return parse_key(raw, f"${KEY_ENV}") if raw else None


def parse_key(text: str, where: str) -> bytes:
    """One hex key; two lines are two keys, never one longer key (fromhex skips spaces)."""
    if len(text.split()) > 1:
        raise InvalidArgumentError(f"{where} must hold one tier key (hex), not several words")
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise InvalidArgumentError(f"{where} must be hex digits (a tier key)") from None
    return check_key(key, where)


def check_key(key: object, where: str = "tier_key") -> bytes:
    """A usable operator key: bytes, 16 or more of them (an empty HMAC key is anyone's)."""
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidArgumentError(f"{where} must be bytes, not {type(key).__name__}")
    if len(key) < 16:
        raise InvalidArgumentError(f"{where} holds {len(key)} bytes: a tier key needs 16 or more")
    return bytes(key)


@dataclass(frozen=True)
class Keys:
    """The operator key (or None: records are trusted as written) and what it derives."""

    key: bytes | None = None

    def __post_init__(self) -> None:
        if self.key is None and not _warned:
            _warned.append(True)  # once per process
            log.warning(
                "persist: no tier key (%s): records on the shared and cold tiers are "
                "trusted as written by anyone who can write them",
                KEY_ENV,
            )

    def mac(self, label: bytes, *parts: bytes | memoryview) -> bytes:
        assert self.key is not None
        h = hmac.new(self.key, label + b"\0", hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "little"))
            h.update(p)
        return h.digest()

    def check(self, label: bytes, tag: Any, *parts: bytes | memoryview) -> None:
        """Raise BadValue unless ``tag`` is this key's tag (no key: nothing to check)."""
        if self.key is None:
            return
        if not isinstance(tag, bytes) or not hmac.compare_digest(tag, self.mac(label, *parts)):
            raise BadValue("unauthenticated", "no valid tag of the operator key")

    def namespace_secret(self, namespace: str) -> bytes | None:
        """HMAC(key, namespace): the same chain secret on every machine, kept nowhere."""
        return None if self.key is None else self.mac(b"namespace", namespace.encode())

    def blob_name(self, key: str) -> str:
        """A blob's name on a tier: its content key, and with an operator key ``.`` and 16
        hex digits of that key's (a key id): a keyless writer's blob, or another key's,
        never stands in for this key's (a rollout or a rotation pushes them again)."""
        return key if self.key is None else f"{key}.{self.mac(b'blob name')[:8].hex()}"

    def blob_tag(self, namespace: str, key: str, data: bytes | memoryview) -> bytes | None:
        if self.key is None:
            return None
        return self.mac(b"blob", namespace_tag(namespace).encode(), key.encode(), data)

    def pointer(self, namespace: str, kind: str, name: bytes, rkey: str) -> bytes:
        """A pointer's value: the record key, and with a key a tag over where it is."""
        if self.key is None:
            return rkey.encode()
        tag = self.mac(
            b"pointer", namespace_tag(namespace).encode(), kind.encode(), name, rkey.encode()
        )
        return f"{rkey}.{tag[:16].hex()}".encode()

    def open_pointer(self, namespace: str, kind: str, name: bytes, value: Any) -> str:
        """The record key a pointer value names; BadValue if it is not a pointer."""
        try:
            text = bytes(value).decode("ascii")
        except (TypeError, ValueError, UnicodeDecodeError):
            raise BadValue("malformed", "a pointer that is not text") from None
        rkey = text.partition(".")[0]
        if len(rkey) != 32 or any(c not in "0123456789abcdef" for c in rkey):
            raise BadValue("malformed", "a pointer without a record key")
        if self.key is not None:
            want = self.pointer(namespace, kind, name, rkey)
            if not hmac.compare_digest(want, text.encode()):
                raise BadValue("unauthenticated", "a pointer without a valid tag")
        return rkey


def seal_record(keys: Keys, namespace: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """(record key, value) of a record body (``ns`` and ``v`` are added here)."""
    packed = msgpack.packb(
        {**body, "v": VERSION, "ns": namespace_tag(namespace)}, use_bin_type=True
    )
    outer: dict[str, Any] = {"v": VERSION, "body": packed, "sum": xxhash.xxh3_128_digest(packed)}
    if keys.key is not None:
        outer["mac"] = keys.mac(b"record", packed)
    return xxhash.xxh3_128_hexdigest(packed), msgpack.packb(outer, use_bin_type=True)


@dataclass
class Expect:
    """What a reader knows about the record it asked for: each field given is checked."""

    namespace: str
    rkey: str | None = None  # the key it was read under
    name: str | None = None  # a session's pointer: the record must be that session's
    secret: bytes | None = None  # the namespace secret: chains are recomputed under it
    block: int | None = None  # this store's block size
    identity: str | None = None  # the identity digest a lookup computed its chains with
    via: tuple[str, bytes] | None = None  # ("blk" | "head", key) of the pointer followed


def open_record(keys: Keys, value: Any, want: Expect, authenticated: bool = True) -> dict[str, Any]:
    """The checked body of a record value, or BadValue (never another exception).
    ``authenticated`` False: its operator key's tag is not checked (``lineage``
    reads an unauthenticated session's tokens and version only to push less)."""
    try:
        if not isinstance(value, bytes) or len(value) > MAX_RECORD:
            raise BadValue("malformed", "not a record value")
        outer = msgpack.unpackb(value, raw=False, **LIMITS)
        if not isinstance(outer, dict) or outer.get("v") != VERSION:
            raise BadValue("malformed", "not a version-2 record")
        packed = outer.get("body")
        if not isinstance(packed, bytes) or outer.get("sum") != xxhash.xxh3_128_digest(packed):
            raise BadValue("malformed", "a record that fails its checksum")
        if authenticated:
            keys.check(b"record", outer.get("mac"), packed)
        if want.rkey is not None and want.rkey != xxhash.xxh3_128_hexdigest(packed):
            raise BadValue("mismatched", "a record under another record's key")
        body = msgpack.unpackb(packed, raw=False, **LIMITS)
        _shape(body)
        _bind(body, want)
        return dict(body)
    except BadValue:
        raise
    except Exception as e:  # any parse or type surprise of a hostile value
        raise BadValue("malformed", f"an unreadable record ({type(e).__name__})") from None


def _shape(body: Any) -> None:
    """Types and internal consistency of a record body, before anything uses it."""
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise BadValue("malformed", "a record body of another version")
    row, blobs, blocks, tail = body["row"], body["blobs"], body["blocks"], body["tail"]
    if not isinstance(row, dict) or set(row) != set(ROW_FIELDS):
        raise BadValue("malformed", "a record row without its fields")
    for k, types in ROW_TYPES.items():
        if not isinstance(row[k], types):
            raise BadValue("malformed", f"a record row whose {k} is a {type(row[k]).__name__}")
    if row["role"] not in ROLES or len(row["root"]) != 16 or len(row["tokens"]) % 4:
        raise BadValue("malformed", "a record row out of range")
    if row["n_tokens"] != len(row["tokens"]) // 4 or row["n_blocks"] != len(blocks):
        raise BadValue("malformed", "a record whose counts disagree")
    if not isinstance(blobs, dict) or not 0 < len(blobs) <= MAX_BLOBS:
        raise BadValue("malformed", "a record without its blobs")
    for k, facts in blobs.items():
        ok = isinstance(k, str) and isinstance(facts, list) and len(facts) == 2
        ok = ok and isinstance(facts[0], int) and 0 < facts[0] <= MAX_BLOB
        if not (ok and isinstance(facts[1], bytes) and len(facts[1]) == 16):
            raise BadValue("malformed", "a record whose blob facts are not size and sums")
    used = {tail}
    for i, b in enumerate(blocks):
        ok = isinstance(b, list) and len(b) == 3 and b[0] == i
        if not (
            ok and isinstance(b[1], bytes) and len(b[1]) == 16 and (b[2] is None or b[2] in blobs)
        ):
            raise BadValue("malformed", "a record whose blocks are not in order")
        used.add(b[2])
    used.discard(None)
    if not isinstance(tail, str) or used != set(blobs):
        raise BadValue("malformed", "a record whose blobs are not the ones its blocks use")
    manifest = msgpack.unpackb(row["manifest"], raw=False, **LIMITS)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("block"), int):
        raise BadValue("malformed", "a record whose manifest has no block size")
    if not 1 <= manifest["block"] <= 1 << 20 or len(blocks) > row["n_tokens"] // manifest["block"]:
        raise BadValue("malformed", "a record with more blocks than tokens")
    secret = body.get("secret")
    if secret is not None and not (isinstance(secret, bytes) and len(secret) == 32):
        raise BadValue("malformed", "a record whose namespace secret is not 32 bytes")


def block_of(body: dict[str, Any]) -> int:
    return int(msgpack.unpackb(body["row"]["manifest"], raw=False)["block"])


def _bind(body: dict[str, Any], want: Expect) -> None:
    """The record is what the reader asked for: namespace, name, identity, chains."""
    row = body["row"]
    if body["ns"] != namespace_tag(want.namespace):
        raise BadValue("mismatched", "a record of another namespace")
    if want.name is not None and (row["name"] != want.name or row["role"] != "session"):
        raise BadValue("mismatched", "a record of another session")
    if want.identity is not None and row["identity"] != want.identity:
        raise BadValue("mismatched", "a record of another model identity")
    block = block_of(body)
    if want.block is not None and block != want.block:
        raise BadValue("mismatched", "a record cut into blocks of another size")
    if want.secret is None:
        return
    packed, step = row["tokens"], 4 * block  # the tokens as chains() packs them
    got = [bytes(row["root"]), *(b[1] for b in body["blocks"])]
    want_chains, last = chains_under(want.secret, row, len(got) - 1)
    if got != want_chains:
        raise BadValue("mismatched", "a record whose chains are not its tokens' chains")
    if row["last_chain"] != last:
        raise BadValue("mismatched", "a record whose last chain is not its last block's")
    if want.via is not None:
        kind, key = want.via
        if kind == "blk":
            held: Sequence[bytes] = got[1:]
        else:  # a head key needs the 16 tokens after each boundary, not all of them
            heads = [
                unpack_tokens(packed[b * step : b * step + 4 * HEAD_TOKENS])
                for b in range(len(got))
            ]
            held = [
                head_key(c, t) for c, t in zip(got, heads, strict=True) if len(t) == HEAD_TOKENS
            ]
        if key not in held:
            raise BadValue("mismatched", f"a {kind} pointer to a record that lacks it")


def chains_under(secret: bytes, row: dict[str, Any], n: int) -> tuple[list[bytes], bytes]:
    """([h_-1, h_0, .., h_{n-1}], last_chain) of a row's tokens under ``secret``: what a
    store whose namespace secret is ``secret`` keeps for it (the tier's chains are
    under the tier's secret, a store's under its own; a push or pull rechains)."""
    block = int(msgpack.unpackb(row["manifest"], raw=False)["block"])
    packed = row["tokens"]
    got = packed_chains(chain_root(secret, row["identity"]), packed, block, n)
    return got, got[-1] if n else head_key(got[0], unpack_tokens(packed[:64]))


def packed_chains(root: bytes, packed: bytes, block: int, n: int) -> list[bytes]:
    """``store.chains.chains(root, tokens, block)[: n + 1]`` from the packed tokens: the
    same hashes without unpacking and packing every block again (a test compares)."""
    out, step = [root], 4 * block
    for i in range(n):
        out.append(
            hashlib.blake2b(out[-1] + packed[i * step : (i + 1) * step], digest_size=16).digest()
        )
    return out


def best_record(
    bodies: list[dict[str, Any]], toks: list[int], quantized_start: int | None = None
) -> tuple[int, dict[str, Any]] | None:
    """(usable prefix, checked body) of the candidate that serves the prompt furthest,
    by the resume policy over its stored tokens (an untrimmable snapshot only at its
    own length)."""
    best: tuple[int, dict[str, Any]] | None = None
    prompt = pack_tokens(toks) if bodies else b""
    for body in bodies:
        row = body["row"]
        lcp = common_prefix_packed(row["tokens"], prompt)  # memcmp, not a loop per token
        # the record's columns narrowed by the rules over its layers (an older peer's
        # columns may predate a rule)
        rule = of_row(
            bool(row["trimmable"]), int(row["min_resume"]), row["manifest"], quantized_start
        )
        p = policy.usable_prefix(row["n_tokens"], lcp, len(toks), rule.trimmable, rule.floor)
        if p and rule.serves(p, row["n_tokens"]) and (best is None or p > best[0]):
            best = (p, body)
    return best
