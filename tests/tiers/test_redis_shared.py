"""Two machines (separate processes, separate roots) sharing one real Redis: sessions and
prefixes saved on one are restored on the other bit for bit; a tier that is down, evicts,
or returns damaged bytes never fails a local operation and never hands out a wrong cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import (
    assert_same_state,
    check_against_child,
    live_state,
    persist_cli,
    prefill,
    run_child,
    tokens_for,
)
from tests.tiers.conftest import RECIPE, Clock

FAMILIES = {"llama": 300, "qwen3_next": 300, "gemma3": 100}


@pytest.mark.parametrize("variant", sorted(FAMILIES))
def test_a_session_saved_on_one_machine_restores_on_another(
    variant: str, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, model_dir = tiny(variant)
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(FAMILIES[variant], seed=5)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(cache, toks, identity=ident, session="work")
    out = tmp_path / "out.safetensors"
    job = {"store": str(tmp_path / "b"), "shared": redis_server.url, "session": "work"}
    run_child(model_dir, [{**job, "next": [3, 9], "out": str(out)}], tmp_path)
    check_against_child(model, cache, out, toks, next_tokens=[3, 9])
    with persist.Store(tmp_path / "b") as b:  # what it pulled is local now
        assert b.entry("work").tokens == len(toks)


def test_a_prefix_computed_on_one_machine_serves_another(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, model_dir = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    stored = tokens_for(600, seed=6)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, stored)[0], stored, identity=ident)  # an anonymous prefix
    prompt = [*stored[:300], (stored[300] + 1) % 256, 4, 4]
    out = tmp_path / "out.safetensors"
    job = {"store": str(tmp_path / "b"), "shared": redis_server.url, "lookup": prompt}
    run_child(model_dir, [{**job, "next": [8], "out": str(out)}], tmp_path)
    want, _ = prefill(model, stored[:300])  # the hit holds exactly a prefill of the prefix
    check_against_child(model, want, out, stored[:300], next_tokens=[8])


def test_namespaces_never_cross(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=7)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s", namespace="tenant-a")
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        assert b.lookup([*toks, 1], identity=ident, namespace="tenant-b") is None
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("s", identity=ident, namespace="tenant-b")
        assert b.restore("s", identity=ident, namespace="tenant-a").tokens == toks
    prefixes = {k.decode().split(":")[1] for k in redis_server.client().keys("persist:*")}
    assert prefixes == {RedisTier.prefix("tenant-a").split(":")[1]}


def test_damaged_or_evicted_values_are_never_used(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=8)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
    r = redis_server.client()
    blob = next(k for k in r.keys("persist:*:blob:*") if r.strlen(k) > 1000)
    value = bytearray(r.get(blob))
    value[-5] ^= 0xFF  # a flipped byte inside a tensor
    r.set(blob, bytes(value))
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        with pytest.raises(persist.CorruptBlobError):
            b.restore("s", identity=ident)
        assert b.entries() == []  # nothing of it was committed
    for k in r.keys("persist:*:blk:*"):  # an LRU took the block pointers
        r.delete(k)
    with persist.Store(tmp_path / "c", shared=redis_server.url) as c:
        assert c.lookup([*toks[:400], 1, 1], identity=ident) is None  # a miss, not an error


def test_a_tier_that_is_down_never_fails_local_work(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=9)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(cache, toks, identity=ident, session="before")
        clock = Clock(a)  # stopped: the breaker's window lasts as long as the test needs
        redis_server.stop()
        a.save(cache, toks, identity=ident, session="during")  # local save stands
        a.save(cache, toks, identity=ident, session="during-2")
        assert a.shared is not None
        counters = a.shared.tier.counters
        assert counters.get("errors", 0) == 1 and counters.get("skipped", 0) >= 1  # one timeout
        assert a.restore("during", identity=ident).tokens == toks
        redis_server.start()  # same port
        clock.advance(a.shared.tier.retry_after_s)  # the breaker's retry time, not waited for
        a.save(cache, toks, identity=ident, session="after")
    assert redis_server.client().exists(f"{RedisTier.prefix('default')}sess:after")


def test_the_cli_continues_a_session_another_machine_saved(
    model_dir: Any, redis_server: Any, tmp_path: Path
) -> None:
    import json

    m = str(model_dir("llama"))

    def generate(home: str, prompt: str, *shared: str, **env: str) -> dict[str, Any]:
        args = ["generate", "--model", m, "--session", "w", "--prompt", prompt, *shared]
        out = persist_cli(tmp_path / home, *args, "--max-tokens", "3", "--json", env=env)
        return dict(json.loads(out.stdout))

    first = generate("a", "a conversation that began on machine a", "--shared", redis_server.url)
    second = generate("b", " and goes on on machine b", PERSIST_SHARED=redis_server.url)
    assert second["source"] == "session" and second["reused_tokens"] == first["session_tokens"]
    alone = generate("c", " and on machine c, which shares nothing")
    assert alone["source"] == "none"


def test_an_acl_confines_a_tenant_to_its_prefix(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """The README's ACL example: a user allowed only namespace a's keys."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=11)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "admin", shared=redis_server.url) as admin:
        admin.save(cache, toks, identity=ident, session="s", namespace="b")
    pattern = f"~{RedisTier.prefix('a')}*"
    redis_server.client().execute_command("ACL", "SETUSER", "alice", "on", ">pw", pattern, *RECIPE)
    alice = redis_server.url.replace("redis://", "redis://alice:pw@")
    with persist.Store(tmp_path / "alice", shared=alice) as store:
        store.save(cache, toks, identity=ident, session="mine", namespace="a")  # allowed
        with pytest.raises(persist.SessionNotFoundError):  # denied: a clean miss, no hang
            store.restore("s", identity=ident, namespace="b")
        assert store.lookup([*toks, 2], identity=ident, namespace="b") is None
        assert store.shared is not None and store.shared.tier.counters.get("denied", 0) >= 1
    assert redis_server.client().exists(f"{RedisTier.prefix('a')}sess:mine")


def test_an_lru_that_evicts_gives_exact_hits_or_none(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r = redis_server.client()
    r.config_set("maxmemory", "1mb")
    r.config_set("maxmemory-policy", "allkeys-lru")
    sessions = {f"s{i}": tokens_for(300, seed=20 + i) for i in range(12)}
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        for name, toks in sessions.items():
            a.save(prefill(model, toks)[0], toks, identity=ident, session=name)
    restored = 0
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        for name, toks in sessions.items():
            try:
                got = b.restore(name, identity=ident)
            except persist.SessionNotFoundError:
                continue  # evicted: absent, never wrong
            restored += 1
            want, _ = prefill(model, toks)
            assert_same_state(live_state(got.cache), live_state(want))
    assert restored < len(sessions)  # the LRU did evict


def test_local_eviction_never_loses_what_the_tier_holds(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    old, new = tokens_for(300, seed=30), tokens_for(300, seed=31)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, old)[0], old, identity=ident, session="old")
        size = a.stats().unique_bytes
        a.gc(max_bytes=0)  # the local copy goes
        assert not a.has_session("old")
        assert a.restore("old", identity=ident).tokens == old  # fetched back
        a.save(prefill(model, new)[0], new, identity=ident, session="new")
        assert a.stats().unique_bytes >= size


def test_sync_pushes_what_the_tier_lacks_and_pulls_named_sessions(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    import json

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=50)
    with persist.Store(tmp_path / "a") as a:  # saved while no tier was configured
        a.save(prefill(model, toks)[0], toks, identity=ident, session="offline")

    def cli(home: str, *args: str) -> dict[str, Any]:
        out = persist_cli(tmp_path / home, "sync", "--shared", redis_server.url, *args)
        return dict(json.loads(out.stdout))

    assert cli("a", "--json")["pushed"] == 1
    got = cli("b", "--pull", "offline", "--pull", "nope", "--json")
    assert got["pulled"] == ["offline"] and got["missing"] == ["nope"]
    with persist.Store(tmp_path / "b") as b:  # local now, no tier needed
        assert b.restore("offline", identity=ident).tokens == toks
        assert b.stats().counters["shared_hits"] == 1


def test_ctrl_c_during_a_pull_leaves_a_consistent_store(
    tiny: Any, redis_server: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """Interrupted after the blobs are written, before the commit: nothing stays."""
    from persist.engine.tiers import pull as tier_pull

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=70)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")

    def interrupted(*_: Any, **__: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(tier_pull, "_commit", interrupted)
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        with pytest.raises(KeyboardInterrupt):
            b.restore("s", identity=ident)
        assert b.entries() == [] and b.check() == []
        assert not list((tmp_path / "b" / "blobs").rglob("*.safetensors"))
        monkeypatch.undo()
        assert b.restore("s", identity=ident).tokens == toks  # and the next try works


def test_a_session_continued_on_a_machine_with_a_slow_clock_is_still_newer(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A session's version is its save time, but never earlier than the one the saving
    store knows: a machine whose clock is behind continues a session and the machines
    that saw the older version take the newer one.  (The turn extends the session's
    tokens: a version alone never lets a push replace a tier's record, attack 38d.)"""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t1 = tokens_for(300, seed=1)
    t2 = [*t1, *tokens_for(20, seed=2)]  # the next turn
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
