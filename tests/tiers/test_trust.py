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
from tests.helpers import assert_same_state, live_state, persist_cli, prefill, tokens_for

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
        with pytest.raises(persist.SessionUnreadableError):  # named there: never "no session"
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
        pytest.raises(persist.SessionUnreadableError, match="key id"),
    ):
        c.restore("y", identity=ident)  # another key: an error naming it, nothing read


def test_a_tampered_blob_with_a_key_is_a_miss(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident, _ = two(model, tok, redis_server.url, tmp_path / "a", key=KEY)
    r = redis_server.client()
    for k in r.keys("persist:*:blob:*"):
        v = bytearray(r.get(k))
        v[-40] ^= 1  # inside the bytes, before the tag
        r.set(k, bytes(v))
    with fresh(tmp_path, redis_server.url, KEY) as b:
        with pytest.raises(persist.SessionUnreadableError):
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
        # a bad pointer or record is a miss; a blob whose record held is read and fails its
        # checks; a record the tier does not return (empty, another type) is named there
        # but unreadable: SessionUnreadableError (attack 38b, finding 8), never "no session"
        typed = persist.CorruptBlobError if kind == "blob" else persist.SessionNotFoundError
        if value in (b"", "hash"):
            typed = persist.SessionUnreadableError
        with pytest.raises(typed):
            b.restore("x", identity=ident)
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
    from persist.engine.tiers.records import packed_chains
    from persist.format.tokens import pack_tokens
    from persist.storage.chains import chains

    toks = tokens_for(1000, seed=3)
    for n in (0, 1, 3):
        assert (
            packed_chains(b"r" * 16, pack_tokens(toks), 256, n)
            == chains(b"r" * 16, toks, 256)[: n + 1]
        )


def test_a_replayed_old_pointer_is_refused_by_every_store_that_saw_the_newer_one(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """An old authentic sess: pointer replayed (by anyone who can write the tier, key or
    not): a store that saved, pulled or pushed a newer version of the session refuses
    it (``shared_stale``), even after deleting its own copy; one that holds the session
    serves its own.  A new machine, which has seen nothing, can be given the older
    authentic state of that same session, never another session's (README, threat
    model; docs/FORMAT.md section 6)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    old = tokens_for(300, seed=1)
    new = [*old, *tokens_for(20, seed=2)]  # the next turn: it takes the name (attack 38d)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, old)[0], old, identity=ident, session="x")
        stale = r.get(f"{p}sess:x")
        a.save(prefill(model, new)[0], new, identity=ident, session="x")
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        assert c.restore("x", identity=ident).tokens == new  # c sees the newer version
        c.delete("x")
    assert r.get(f"{p}sess:x") != stale
    r.set(f"{p}sess:x", stale)  # the attacker replays the authentic old pointer
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        assert a.restore("x", identity=ident).tokens == new  # its own copy, not the tier's
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        with pytest.raises(persist.SessionNotFoundError):
            c.restore("x", identity=ident)  # deleted here, and the tier's is older
        assert c.stats().counters["shared_stale"] == 1
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.restore("x", identity=ident).tokens == old  # documented: x, never y's


def test_adding_an_operator_key_to_an_existing_fleet_keeps_it_sharing(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """The README's rollout of an operator key to a fleet that ran without one: machine
    a's store keeps its old random chain secret and rechains at the tier's edge, so
    what it saves with the key is shared; its keyless records are misses for keyed
    machines (``shared_unauthenticated``: they are trusted by nobody) until ``sync
    --rekey`` publishes them again under the key (without ``rekey`` a keyless session
    pointer is a conflict, never replaced: attack 38b, finding 5)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    before, after = tokens_for(300, seed=5), tokens_for(300, seed=6)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, before)[0], before, identity=ident, session="before")
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        with pytest.raises(persist.SessionUnreadableError, match="key id"):
            c.restore("before", identity=ident)  # until sync publishes it under the key
        assert c.stats().counters["shared_unauthenticated"] == 1
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, after)[0], after, identity=ident, session="after")
        assert [c["session"] for c in a.sync()["conflicts"]] == ["before"]
        done = a.sync(rekey=True)
        assert done["failed"] == 0 and not done["conflicts"], done
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.restore("after", identity=ident).tokens == after  # saved by a with the key
        assert b.restore("before", identity=ident).tokens == before  # published by sync
        hit = b.lookup([*before[:280], 9], identity=ident)  # a's chains, rechained
        assert hit is not None and hit.tokens == before[:280]


def test_an_empty_or_short_tier_key_is_refused(redis_server: Any, tmp_path: Path) -> None:
    """$PERSIST_TIER_KEY and --tier-key-file refuse a key under 16 bytes; the library takes
    b'' and b'x', so every record's 'authentic' tag is one any writer can forge."""
    for i, k in enumerate([b"", b"x"]):
        with pytest.raises(persist.errors.InvalidArgumentError):
            persist.Store(tmp_path / f"s{i}", shared=redis_server.url, tier_key=k).close()


def test_a_tier_key_of_the_wrong_type_is_a_typed_error(redis_server: Any, tmp_path: Path) -> None:
    """A key passed as its hex text is refused when the store opens, not at a save's
    HMAC as a TypeError."""
    with pytest.raises(persist.errors.InvalidArgumentError, match="must be bytes, not str"):
        persist.Store(tmp_path / "s", shared=redis_server.url, tier_key=KEY.hex())  # type: ignore[arg-type]


def test_a_key_file_with_two_keys_is_refused(redis_server: Any, tmp_path: Path) -> None:
    """A key file where a rotated key was appended (or one pasted twice) is silently a
    third, 64-byte key: the machine given it shares with nobody and says nothing."""
    kf = tmp_path / "tier.key"
    kf.write_text(KEY.hex() + "\n" + bytes(32).hex() + "\n")
    out = persist_cli(
        tmp_path / "h",
        "sync",
        "--shared",
        redis_server.url,
        "--tier-key-file",
        str(kf),
        check=False,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "must hold one tier key (hex), not several words" in out.stderr, out.stderr


def test_a_huge_pointer_value_is_not_read_whole(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A pointer is under 100 bytes (S3 reads at most 128); on Redis a hostile value of
    any size (up to 512 MB, times every chain key a lookup asks for) is read whole."""
    model, tok, _ = tiny("llama")
    ident, toks = two(model, tok, redis_server.url, tmp_path / "a")
    r, p = redis_server.client(), RedisTier.prefix("default")
    big = b"0" * (32 << 20)
    r.set(f"{p}sess:x", big)
    for k in r.keys(p.encode() + b"blk:*") + r.keys(p.encode() + b"head:*"):
        r.set(k, big)

    def sent() -> int:
        return int(r.info("stats")["total_net_output_bytes"])

    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        before = sent()
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("x", identity=ident)
        assert b.lookup([*toks["y"], 5], identity=ident) is None
        assert sent() - before < 1 << 20, f"{sent() - before} bytes read for pointers"
