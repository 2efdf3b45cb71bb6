"""The namespace secret under an LRU that may evict it, and a sync that says what it did
(real redis-server, `persist sync` as a user runs it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import assert_same_state, live_state, persist_cli, prefill, tokens_for
from tests.tiers.conftest import Clock

PREFIX = RedisTier.prefix("default")


def machine(tmp: Path, name: str, url: str) -> persist.Store:
    return persist.Store(tmp / name, shared=url)


def test_a_secret_deleted_by_hand_is_recovered_and_the_fleet_stays_one(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    doc, other = tokens_for(300, seed=3), tokens_for(300, seed=4)
    with machine(tmp_path, "a", redis_server.url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident)  # an anonymous prefix
    r = redis_server.client()
    r.delete(f"{PREFIX}secret")
    with machine(tmp_path, "b", redis_server.url) as b:  # a new machine: no secret anywhere
        hit = b.lookup([*doc[:280], 9], identity=ident)
        assert hit is not None and hit.tokens == doc[:280]
        assert_same_state(live_state(hit.cache), live_state(prefill(model, doc[:280])[0]))
        assert b.stats().counters["shared_secret_recovered"] == 1
        b.save(prefill(model, other)[0], other, identity=ident, session="from-b")
    assert r.exists(f"{PREFIX}secret")  # put back
    r.delete(f"{PREFIX}secret")
    with machine(tmp_path, "c", redis_server.url) as c:  # a third one, after a second loss
        assert c.restore("from-b", identity=ident).tokens == other
        c.save(prefill(model, doc)[0], doc, identity=ident, session="from-c")
    with machine(tmp_path, "a", redis_server.url) as a:  # and the first sees both
        assert a.restore("from-c", identity=ident).tokens == doc
        assert a.restore("from-b", identity=ident).tokens == other


def test_allkeys_lru_under_pressure_never_splits_the_fleet(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """What a fresh machine restores does not depend on whether the LRU kept the secret."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r = redis_server.client()
    r.config_set("maxmemory", "3mb")
    r.config_set("maxmemory-policy", "allkeys-lru")
    sessions = {f"s{i}": tokens_for(300, seed=60 + i) for i in range(30)}
    with machine(tmp_path, "a", redis_server.url) as a:
        for name, toks in sessions.items():
            a.save(prefill(model, toks)[0], toks, identity=ident, session=name)

    def restorable(root: str) -> set[str]:
        got = set()
        with machine(tmp_path, root, redis_server.url) as m:
            for name, toks in sessions.items():
                try:
                    out = m.restore(name, identity=ident)
                except (persist.SessionNotFoundError, persist.SessionUnreadableError):
                    continue  # evicted, or named there with a part evicted
                assert out.tokens == toks  # never another session
                got.add(name)
        return got

    r.config_set("maxmemory", "0")  # no more eviction while the two machines read
    before = restorable("b")
    r.delete(f"{PREFIX}secret")  # as if the LRU had taken it now
    assert restorable("c") == before and len(before) >= 5
    with machine(tmp_path, "d", redis_server.url) as d:  # a save plants no new secret
        toks = tokens_for(300, seed=99)
        d.save(prefill(model, toks)[0], toks, identity=ident, session="new")
    with machine(tmp_path, "a", redis_server.url) as a:
        assert a.restore("new", identity=ident).tokens == toks


def test_sync_says_what_it_pushed_and_fails_when_a_tier_is_down(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "a") as a:  # saved while no tier was configured
        for i in range(2):
            toks = tokens_for(300, seed=80 + i)
            a.save(prefill(model, toks)[0], toks, identity=ident, session=f"s{i}")

    def sync() -> tuple[int, dict[str, Any]]:
        args = ["sync", "--shared", redis_server.url, "--json"]
        out = persist_cli(tmp_path / "a", *args, check=False)
        return out.returncode, dict(json.loads(out.stdout))

    redis_server.stop()
    rc, got = sync()
    assert rc == 1 and got["pushed"] == 0 and got["failed"] == 2, got
    redis_server.start()
    rc, got = sync()
    assert rc == 0 and got["pushed"] == 2 and got["failed"] == 0, got
    rc, got = sync()
    assert rc == 0 and got["present"] == 2 and got["pushed"] == 0, got
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:  # the library too
        clock = Clock(a)
        redis_server.stop()
        report = a.sync()
        assert report["failed"] == 2 and report["tiers"]["shared"]["failed"] == 2
        redis_server.start()
        assert a.shared is not None
        clock.advance(a.shared.tier.retry_after_s)  # the breaker's retry time, not waited for
        assert a.sync()["pushed"] == 2  # a restarted server, empty
        assert a.sync()["present"] == 2


def test_a_cluster_that_lost_the_secret_recovers_it(
    tiny: Any, redis_cluster: Any, tmp_path: Path
) -> None:
    """The bounded SCAN asks every node of a three-node cluster: the record it finds
    may live on any of them."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    doc = tokens_for(300, seed=5)
    with machine(tmp_path, "a", redis_cluster.url) as a:
        a.save(prefill(model, doc)[0], doc, identity=ident)
    from redis.cluster import RedisCluster

    port = redis_cluster.nodes[0].port
    assert RedisCluster(host="127.0.0.1", port=port).delete(f"{PREFIX}secret") == 1
    with machine(tmp_path, "b", redis_cluster.url) as b:
        hit = b.lookup([*doc[:280], 9], identity=ident)
        assert hit is not None and hit.tokens == doc[:280]
        assert_same_state(live_state(hit.cache), live_state(prefill(model, doc[:280])[0]))


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
