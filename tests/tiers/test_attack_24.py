"""Attacks on issue 24's fleet tiers (authenticated records, truthful sync, S3 names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import persist_cli, prefill, tokens_for

KEY = bytes(range(32))


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
    old, new = tokens_for(300, seed=1), tokens_for(320, seed=2)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, old)[0], old, identity=ident, session="x")
        stale = r.get(f"{p}sess:x")
        a.save(prefill(model, new)[0], new, identity=ident, session="x")
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        assert c.restore("x", identity=ident).tokens == new  # c sees the newer version
        c.delete("x")
    assert r.get(f"{p}sess:x") != stale
    r.set(f"{p}sess:x", stale)  # the attacker replays the authentic old pointer
    for root in ("a", "c"):
        with persist.Store(tmp_path / root, shared=redis_server.url, tier_key=KEY) as m:
            try:
                got = m.restore("x", identity=ident)
            except persist.SessionNotFoundError:
                assert root == "c" and m.stats().counters["shared_stale"] == 1
                continue
            assert root == "a" and got.tokens == new, "the stale version was restored"
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.restore("x", identity=ident).tokens == old  # documented: x, never y's


def test_a_session_continued_on_a_machine_with_a_slow_clock_is_still_newer(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A session's version is its save time, but never earlier than the one the saving
    store knows: a machine whose clock is behind continues a session and the machines
    that saw the older version take the newer one."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t1, t2 = tokens_for(300, seed=1), tokens_for(300, seed=2)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, t1)[0], t1, identity=ident, session="x")
        ahead = a.entry("x").created + 3600.0
        a.index.saw("default", "x", ahead)  # as if a's clock were an hour ahead
        a.delete("x")
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        b.restore("x", identity=ident)
        b.index.saw("default", "x", ahead)  # b pulled the version of a's fast clock
        b.save(prefill(model, t2)[0], t2, identity=ident, session="x")
        assert b.entry("x").created > ahead
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        assert a.restore("x", identity=ident).tokens == t2


def test_adding_an_operator_key_to_an_existing_fleet_keeps_it_sharing(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """The README's rollout of an operator key to a fleet that ran without one: machine
    a's store keeps its old random chain secret and rechains at the tier's edge, so
    what it saves with the key is shared; its keyless records are misses for keyed
    machines (``shared_unauthenticated``: they are trusted by nobody) until ``sync``
    publishes them again under the key."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    before, after = tokens_for(300, seed=5), tokens_for(300, seed=6)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, before)[0], before, identity=ident, session="before")
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        with pytest.raises(persist.SessionNotFoundError):
            c.restore("before", identity=ident)
        assert c.stats().counters["shared_unauthenticated"] == 1
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, after)[0], after, identity=ident, session="after")
        assert a.sync()["failed"] == 0
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


def test_a_tier_key_of_the_wrong_type_is_a_typed_error(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t = tokens_for(300, seed=1)
    try:
        with persist.Store(tmp_path / "s", shared=redis_server.url, tier_key=KEY.hex()) as s:  # type: ignore[arg-type]
            s.save(prefill(model, t)[0], t, identity=ident, session="x")
    except persist.errors.PersistError:
        return  # refused, typed
    except TypeError as e:
        pytest.fail(f"untyped exception: {e}")


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
    assert out.returncode != 0, out.stdout


def test_every_name_check_name_accepts_saves_or_is_a_typed_refusal(
    tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    """README: any session name reaches S3; check_name: any text without NUL."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t = tokens_for(260, seed=1)
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        try:
            a.save(prefill(model, t)[0], t, identity=ident, session="a\udcffb")
        except persist.errors.PersistError:
            return
        except UnicodeError as e:
            pytest.fail(f"untyped exception: {e}")
    with persist.Store(tmp_path / "b", cold=s3_server.url) as b:
        assert b.restore("a\udcffb", identity=ident).tokens == t


def test_a_redis_restart_never_splits_a_keyless_fleet(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """README: Redis is a cache (what it holds is gone with its memory) and the namespace
    secret is recovered when it disappears, so allkeys-lru never splits a fleet.  Losing
    everything (a restart, or an LRU that took every key) and a new machine saving first:"""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t1, t2, t3 = tokens_for(300, seed=11), tokens_for(300, seed=12), tokens_for(300, seed=13)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, t1)[0], t1, identity=ident, session="from-a")
    redis_server.client().flushall()  # the server restarted (no persistence, as advised)
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:  # a new machine
        b.save(prefill(model, t2)[0], t2, identity=ident, session="from-b")
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, t3)[0], t3, identity=ident, session="from-a-again")
        assert a.restore("from-b", identity=ident).tokens == t2
    with persist.Store(tmp_path / "c", shared=redis_server.url) as c:
        assert c.restore("from-a-again", identity=ident).tokens == t3


def test_sync_pull_with_the_tier_down_is_a_failure_not_a_miss(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """README: sync reports what failed and exits 1 if anything failed.  A pull that could
    not ask the only tier is a failure, not 'not in any tier'."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t = tokens_for(300, seed=1)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, t)[0], t, identity=ident, session="x")
    redis_server.stop()  # x is on the tier; the tier is down
    out = persist_cli(
        tmp_path / "b", "sync", "--shared", redis_server.url, "--pull", "x", check=False
    )
    assert out.returncode == 1, out.stdout
    assert "not in any tier" not in out.stdout, out.stdout


def test_a_huge_pointer_value_is_not_read_whole(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A pointer is under 100 bytes (S3 reads at most 128); on Redis a hostile value of
    any size (up to 512 MB, times every chain key a lookup asks for) is read whole."""
    from tests.tiers.test_trust import two

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


def test_one_malformed_record_never_blocks_secret_recovery(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """README: a value that is not persist's is a miss for that key only; an evicted
    secret is recovered from a record.  The recovery SCAN opens only the first record."""
    from persist.remote.redis_tier import SCAN_COUNT

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    p = RedisTier.prefix("default")
    doc = tokens_for(300, seed=3)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident)  # an anonymous prefix
    r = redis_server.client()
    r.delete(f"{p}secret")  # evicted
    for i in range(200):  # bounded: until SCAN meets a bad record first
        r.set(f"{p}rec:{i:032x}", b"not a record")
        first = r.scan(0, match=f"{p}rec:*", count=SCAN_COUNT)[1]
        if first and r.get(first[0]) == b"not a record":
            break
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:  # a new machine
        hit = b.lookup([*doc[:280], 9], identity=ident)
        assert hit is not None and hit.tokens == doc[:280]


def test_a_secret_of_another_type_breaks_only_that_key(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """README: a value that is not persist's (another type) is a miss for that key only,
    never a broken namespace; a secret that disappeared is recovered from a record."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    p = RedisTier.prefix("default")
    doc, other = tokens_for(300, seed=3), tokens_for(300, seed=4)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident)
    r = redis_server.client()
    r.delete(f"{p}secret")
    r.rpush(f"{p}secret", b"a")  # a key of another type where the secret was
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:  # a new machine
        hit = b.lookup([*doc[:280], 9], identity=ident)
        b.save(prefill(model, other)[0], other, identity=ident, session="o")
        assert b.sync()["failed"] == 0
        assert hit is not None and hit.tokens == doc[:280]
