"""The tier's secret is the fleet's, whatever happened to it, and every read of it and
of a pointer is bounded (real redis-server, a three-node cluster, moto's S3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import prefill, tokens_for
from tests.tiers.conftest import Clock

P = RedisTier.prefix("default")
KEY, KEY2 = bytes(range(32)), bytes(range(32, 64))


def _ident(tiny: Any) -> tuple[Any, Any]:
    model, tok, _ = tiny("llama")
    return model, persist.ModelIdentity.of(model, tok)


def test_a_running_store_follows_a_secret_another_machine_planted(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A Redis that lost everything while store a stays open, and a new machine that
    saved first: a's next save reads the new secret back in its own round trip and
    pushes again under it; a's lookups follow once its secret is asked for again."""
    model, ident = _ident(tiny)
    t1, t2, t3 = (tokens_for(300, seed=s) for s in (21, 22, 23))
    r = redis_server.client()
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        clock = Clock(a)
        a.save(prefill(model, t1)[0], t1, identity=ident, session="one")
        r.flushall()
        with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
            b.save(prefill(model, t2)[0], t2, identity=ident)  # plants its own secret
        a.save(prefill(model, t3)[0], t3, identity=ident, session="three")
        with persist.Store(tmp_path / "c", shared=redis_server.url) as c:
            assert c.restore("three", identity=ident).tokens == t3
        clock.advance(60)  # past the time a keyless secret is held without asking again
        hit = a.lookup([*t2[:280], 9], identity=ident)  # b's prefix, under b's secret
        assert hit is not None and hit.tokens == t2[:280]


@pytest.mark.parametrize(
    "bad", [b"short", b"x" * 33, b"0" * (8 << 20)], ids=["short", "33-bytes", "8-MiB"]
)  # an 8 MiB id would go into PYTEST_CURRENT_TEST: too long for a child's environment
def test_a_secret_that_is_no_secret_is_replaced_and_counted(
    bad: bytes, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, ident = _ident(tiny)
    doc, other = tokens_for(300, seed=3), tokens_for(300, seed=4)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident)
    r = redis_server.client()
    r.set(f"{P}secret", bad)
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        sent = int(r.info("stats")["total_net_output_bytes"])
        hit = b.lookup([*doc[:280], 9], identity=ident)  # recovered from a's record
        assert hit is not None and hit.tokens == doc[:280]
        assert int(r.info("stats")["total_net_output_bytes"]) - sent < 1 << 20
        b.save(prefill(model, other)[0], other, identity=ident, session="o")
        assert b.shared is not None and b.shared.tier.counters["bad_values"] >= 1
    assert len(r.get(f"{P}secret")) == 32
    with persist.Store(tmp_path / "c", shared=redis_server.url) as c:
        assert c.restore("o", identity=ident).tokens == other


def test_without_scripts_pointer_reads_are_still_bounded(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """An ACL without +@scripting: the lookup's pointers come in a pipeline of GETRANGEs."""
    model, ident = _ident(tiny)
    doc = tokens_for(600, seed=7)
    r = redis_server.client()
    r.execute_command("ACL", "SETUSER", "u", "on", ">pw", "~persist:*", "+@all", "-@scripting")
    url = redis_server.url.replace("redis://", "redis://u:pw@")
    with persist.Store(tmp_path / "a", shared=url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident, session="doc")
    for k in r.keys(f"{P}blk:*"):
        r.set(k, b"0" * (8 << 20))  # hostile, huge
    with persist.Store(tmp_path / "b", shared=url) as b:
        sent = int(r.info("stats")["total_net_output_bytes"])
        hit = b.lookup([*doc[:500], 9], identity=ident)  # the head keys still lead to it
        assert int(r.info("stats")["total_net_output_bytes"]) - sent < 1 << 20
        assert hit is not None and hit.tokens == doc[:500]
        assert b.shared is not None and not b.shared.tier._reads.scripted


def test_a_cluster_reads_pointers_bounded(tiny: Any, redis_cluster: Any, tmp_path: Path) -> None:
    model, ident = _ident(tiny)
    doc = tokens_for(600, seed=8)
    with persist.Store(tmp_path / "a", shared=redis_cluster.url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident, session="doc")
    from redis.cluster import RedisCluster

    rc = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    rc.set(f"{P}sess:doc", b"0" * (8 << 20))
    with persist.Store(tmp_path / "b", shared=redis_cluster.url) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("doc", identity=ident)
        assert b.shared is not None and b.shared.tier.counters["bad_values"] == 1
        hit = b.lookup([*doc[:520], 9], identity=ident)
        assert hit is not None and hit.tokens == doc[:520]


def test_a_rotated_key_pushes_its_own_blobs(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    """Blobs on a tier are named with the key's id: those of the old key (or of no key)
    never stand in for the new key's, so a sync after a rotation shares again.  The
    old key's session pointer is replaced only with ``rekey`` (attack 38b, finding 5:
    a machine cannot tell an old key's value from the fleet's under a key it lacks)."""
    model, ident = _ident(tiny)
    t = tokens_for(300, seed=9)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, t)[0], t, identity=ident, session="s")
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY2) as b:
        with pytest.raises(persist.SessionUnreadableError, match="key id"):
            b.restore("s", identity=ident)  # the old key's record: unauthenticated
        assert b.stats().counters["shared_unauthenticated"] == 1
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY2) as a:
        assert [c["session"] for c in a.sync()["conflicts"]] == ["s"]  # not without rekey
        assert a.sync(rekey=True)["pushed"] == 1
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY2) as c:
        assert c.restore("s", identity=ident).tokens == t


def test_a_lost_shared_secret_comes_back_from_the_cold_tier(
    tiny: Any, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """No record left on Redis to recover it from: the cold tier's copy, the same one."""
    model, ident = _ident(tiny)
    t1, t2 = tokens_for(300, seed=31), tokens_for(300, seed=32)
    tiers = {"shared": redis_server.url, "cold": s3_server.url}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save(prefill(model, t1)[0], t1, identity=ident, session="one")
        first = redis_server.client().get(f"{P}secret")
    redis_server.client().flushall()
    with persist.Store(tmp_path / "b", **tiers) as b:
        b.save(prefill(model, t2)[0], t2, identity=ident, session="two")
    assert redis_server.client().get(f"{P}secret") == first
    with persist.Store(tmp_path / "c", shared=redis_server.url) as c:
        assert c.restore("two", identity=ident).tokens == t2


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
