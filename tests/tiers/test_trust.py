"""A tier anyone can write: records bound to what they claim, authenticated with an
operator key, hostile values typed misses, reads bounded by the record (real
redis-server; the S3 cases in test_s3_names.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash

import persist
from persist.remote import redis_tier
from persist.remote.redis_tier import RedisTier
from tests.helpers import assert_same_state, live_state, prefill, tokens_for

KEY = bytes(range(32))


def two(model: Any, tok: Any, url: str, root: Path, key: bytes | None = None, **kw: Any) -> Any:
    """Sessions x and y (300 tokens each) saved on machine ``root``; their tokens."""
    ident = persist.ModelIdentity.of(model, tok)
    toks = {"x": tokens_for(300, seed=1), "y": tokens_for(300, seed=2)}
    with persist.Store(root, shared=url, tier_key=key) as a:
        for name, t in toks.items():
            a.save(prefill(model, t)[0], t, identity=ident, session=name, **kw)
    return ident, toks


def rec_of(r: Any, name: str, ns: str = "default") -> bytes:
    """The key of the record session ``name``'s pointer names."""
    ptr = r.get(f"{RedisTier.prefix(ns)}sess:{name}")
    return f"{RedisTier.prefix(ns)}rec:{ptr.decode().split('.')[0]}".encode()


def fresh(tmp: Path, url: str, key: bytes | None = None) -> persist.Store:
    return persist.Store(tmp / f"fresh{len(list(tmp.iterdir()))}", shared=url, tier_key=key)


def test_a_renamed_record_is_a_miss(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a")
    r, p = redis_server.client(), RedisTier.prefix("default")
    r.set(f"{p}sess:y", r.get(f"{p}sess:x"))  # y's name, x's record
    with fresh(tmp_path, redis_server.url) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("y", identity=ident)
        assert b.stats().counters["shared_mismatched"] == 1
        got = b.restore("x", identity=ident)  # the honest one still restores, bit for bit
        assert_same_state(live_state(got.cache), live_state(prefill(model, toks["x"])[0]))


def test_y_replaced_by_x_is_a_miss_and_lookup_still_works(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a")
    r = redis_server.client()
    r.set(rec_of(r, "y"), r.get(rec_of(r, "x")))  # y's record key holds x's record
    with fresh(tmp_path, redis_server.url) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("y", identity=ident)
        hit = b.lookup([*toks["x"], 5], identity=ident)
        assert hit is not None and hit.tokens == toks["x"]
        assert b.stats().counters["shared_mismatched"] >= 1


def test_another_namespaces_keys_copied_in_are_misses(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a", namespace="a")
    r = redis_server.client()
    pa, pb = RedisTier.prefix("a").encode(), RedisTier.prefix("b").encode()
    for k in r.keys(pa + b"*"):
        r.set(pb + k[len(pa) :], r.get(k))  # the whole namespace, secret included
    with fresh(tmp_path, redis_server.url) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("x", identity=ident, namespace="b")
        assert b.lookup([*toks["x"], 5], identity=ident, namespace="b") is None
        assert b.entries() == [] and b.stats().counters["shared_mismatched"] >= 1


def forge(r: Any, tokens_of: str, blobs_of: str, mac: bytes | None) -> None:
    """Session ``tokens_of``'s record with ``blobs_of``'s blobs, its checksum made again
    (what anyone who can write the tier can do), under the first one's record key."""
    a, b = (msgpack.unpackb(r.get(rec_of(r, n)), raw=False) for n in (tokens_of, blobs_of))
    body_a, body_b = (msgpack.unpackb(o["body"], raw=False) for o in (a, b))
    for k in ("blocks", "tail", "blobs"):
        body_a[k] = body_b[k]
    packed = msgpack.packb(body_a, use_bin_type=True)
    outer = {"v": 2, "body": packed, "sum": xxhash.xxh3_128_digest(packed)}
    if mac is not None:
        outer["mac"] = mac
    r.set(rec_of(r, tokens_of), msgpack.packb(outer, use_bin_type=True))


@pytest.mark.parametrize("old_mac", [False, True])
def test_with_a_key_a_forged_record_is_a_miss(
    old_mac: bool, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a", key=KEY)
    r = redis_server.client()
    mac = msgpack.unpackb(r.get(rec_of(r, "x")), raw=False)["mac"] if old_mac else None
    forge(r, "x", "y", mac)  # x's tokens, y's caches
    with fresh(tmp_path, redis_server.url, KEY) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("x", identity=ident)
        assert b.lookup([*toks["x"], 5], identity=ident) is None
        assert b.stats().counters["shared_unauthenticated"] >= 2
        got = b.restore("y", identity=ident)
        assert_same_state(live_state(got.cache), live_state(prefill(model, toks["y"])[0]))


def test_a_keyed_fleet_shares_bit_for_bit_and_keeps_no_secret_on_the_tier(
    tiny: Any, redis_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a", key=KEY)
    r = redis_server.client()
    assert not r.exists(f"{RedisTier.prefix('default')}secret")  # derived, kept nowhere
    monkeypatch.setenv("PERSIST_TIER_KEY", KEY.hex())
    with fresh(tmp_path, redis_server.url) as b:  # the key from the environment
        hit = b.lookup([*toks["x"][:280], 7, 7], identity=ident)
        assert hit is not None and hit.tokens == toks["x"][:280]
        want = prefill(model, toks["x"][:280])[0]
        assert_same_state(live_state(hit.cache), live_state(want))
        got = b.restore("y", identity=ident)
        assert_same_state(live_state(got.cache), live_state(prefill(model, toks["y"])[0]))
    with (
        fresh(tmp_path, redis_server.url, bytes(32)) as c,
        pytest.raises(persist.SessionNotFoundError),
    ):
        c.restore("y", identity=ident)  # another key: nothing


def test_a_tampered_blob_with_a_key_is_a_miss(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident, _ = two(model, tok, redis_server.url, tmp_path / "a", key=KEY)
    r = redis_server.client()
    for k in r.keys("persist:*:blob:*"):
        v = bytearray(r.get(k))
        v[-40] ^= 1  # inside the bytes, before the tag
        r.set(k, bytes(v))
    with fresh(tmp_path, redis_server.url, KEY) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("x", identity=ident)
        assert b.entries() == [] and b.stats().counters["shared_unauthenticated"] == 1


HOSTILE: dict[str, Any] = {
    "parts marker not a number": ("blob", b"parts:abc"),
    "non-UTF-8 session pointer": ("sess", b"\xff\xfe\x00"),
    "record without its row": ("rec", "norow"),
    "record of the wrong types": ("rec", "types"),
    "pointer that is a list": ("sess", "list"),
    "record that is a hash": ("rec", "hash"),
    "empty record": ("rec", b""),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_values_are_typed_misses_for_that_key_only(
    case: str, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a")
    r, p = redis_server.client(), RedisTier.prefix("default")
    kind, value = HOSTILE[case]
    rx = rec_of(r, "x")
    target = {"sess": f"{p}sess:x".encode(), "rec": rx}.get(kind)
    if kind == "blob":
        body = msgpack.unpackb(msgpack.unpackb(r.get(rx), raw=False)["body"], raw=False)
        target = f"{p}blob:{body['tail']}".encode()
    if value in ("norow", "types"):
        outer = msgpack.unpackb(r.get(rx), raw=False)
        body = msgpack.unpackb(outer["body"], raw=False)
        if value == "norow":
            del body["row"]
        else:
            body["row"]["n_tokens"], body["blocks"] = "many", {"a": 1}
        packed = msgpack.packb(body, use_bin_type=True)
        value = msgpack.packb({**outer, "body": packed, "sum": xxhash.xxh3_128_digest(packed)})
    r.delete(target)
    if value == "list":
        r.rpush(target, b"a")
    elif value == "hash":
        r.hset(target, "a", "b")
    else:
        r.set(target, value)
    with fresh(tmp_path, redis_server.url) as b:
        try:
            b.restore("x", identity=ident)
            raise AssertionError("a hostile value was restored")
        except (persist.SessionNotFoundError, persist.CorruptBlobError):
            pass  # typed: a miss, or a blob that failed its checks
        got = b.restore("y", identity=ident)  # the rest of the namespace is untouched
        assert got.tokens == toks["y"]
        hit = b.lookup([*toks["y"], 1], identity=ident)
        assert hit is not None and hit.tokens == toks["y"]
        assert b.shared is not None and b.shared.tier.counters.get("errors", 0) == 0


def test_a_huge_part_count_is_refused_before_the_first_get(
    tiny: Any, redis_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_tier, "PART_BYTES", 4096)  # tiny blobs in several parts
    model, tok, _ = tiny("llama")
    ident, _ = two(model, tok, redis_server.url, tmp_path / "a")
    r = redis_server.client()
    roots = [k for k in r.keys("persist:*:blob:*") if r.get(k).startswith(b"parts:")]
    assert roots
    for k in roots:
        r.set(k, b"parts:3000000")

    def getranges() -> int:
        return int(r.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))

    before = getranges()
    with (
        fresh(tmp_path, redis_server.url) as b,
        pytest.raises(persist.CorruptBlobError, match="parts"),
    ):
        b.restore("x", identity=ident)
    assert getranges() - before < 10  # the markers and the record, not millions of parts


def test_packed_chains_are_the_stores_chains() -> None:
    from persist.engine.tiers.exchange.records import packed_chains

    from persist.format.tokens import pack_tokens
    from persist.storage.chains import chains

    toks = tokens_for(1000, seed=3)
    for n in (0, 1, 3):
        assert (
            packed_chains(b"r" * 16, pack_tokens(toks), 256, n)
            == chains(b"r" * 16, toks, 256)[: n + 1]
        )
