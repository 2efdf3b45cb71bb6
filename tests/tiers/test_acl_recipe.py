"""The Redis ACL that docs/fleet.md gives a tenant's machines, on a real redis-server:
it confines the user to its namespace's keys (no admin command, no command that
lists or wipes every key), and the fleet still works under it, also when the tier
has no secret for the namespace yet or lost it (the secret's recovery lists keys by
SCAN, which the recipe refuses: a refused search is no search, the secret is planted
again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import assert_same_state, live_state, prefill, tokens_for
from tests.tiers.conftest import RECIPE

REFUSED = [
    ("ACL", "SETUSER", "alice", "~*"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "GET", "*"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("RANDOMKEY",),
]


def _alice(redis_server: Any) -> str:
    rules = (f"~{RedisTier.prefix('a')}*", *RECIPE)
    redis_server.client().execute_command("ACL", "SETUSER", "alice", "on", ">pw", *rules)
    return str(redis_server.url).replace("redis://", "redis://alice:pw@")


def test_the_recipe_refuses_what_reaches_other_tenants(redis_server: Any) -> None:
    import redis

    redis_server.client().set(f"{RedisTier.prefix('b')}sess:theirs", b"x")
    user = redis.Redis.from_url(_alice(redis_server))
    for command in REFUSED:
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.get(f"{RedisTier.prefix('b')}sess:theirs")
    assert redis_server.client().exists(f"{RedisTier.prefix('b')}sess:theirs")


@pytest.mark.parametrize("secret_lost", [False, True])
def test_a_keyless_fleet_works_under_the_recipe(
    secret_lost: bool, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """Without an operator key the secret lives on the tier; its recovery is refused,
    so a lost one is planted again: what is saved after that is shared, and what was
    saved before is a miss for machines that never read it (docs/fleet.md says so)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks, more = tokens_for(300, seed=12), tokens_for(300, seed=13)
    alice = _alice(redis_server)
    with persist.Store(tmp_path / "one", shared=alice) as store:  # a namespace new to the tier
        store.save(prefill(model, toks)[0], toks, identity=ident, session="mine", namespace="a")
        assert store.shared is not None and store.shared.tier.counters.get("bytes_pushed")
    shared = [("mine", toks)]
    if secret_lost:  # an LRU evicted it: the next save's search for it is refused
        redis_server.client().delete(f"{RedisTier.prefix('a')}secret")
        with persist.Store(tmp_path / "three", shared=alice) as store:
            store.save(prefill(model, more)[0], more, identity=ident, session="more", namespace="a")
            assert store.index.counters("a").get("shared_recovery_refused")
        shared = [("more", more)]
    with persist.Store(tmp_path / "two", shared=alice) as other:  # another of alice's machines
        for name, want in shared:
            got = other.restore(name, identity=ident, namespace="a")
            assert got.tokens == want
            assert_same_state(live_state(got.cache), live_state(prefill(model, want)[0]))


def test_a_keyed_fleet_never_searches_the_tier(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """With an operator key the secret is derived, never on the tier: no search, no
    refusal, and a lost key on the tier loses nothing."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks, more = tokens_for(300, seed=14), tokens_for(300, seed=15)
    alice, key = _alice(redis_server), b"k" * 32
    with persist.Store(tmp_path / "one", shared=alice, tier_key=key) as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="mine", namespace="a")
    with persist.Store(tmp_path / "three", shared=alice, tier_key=key) as store:
        store.save(prefill(model, more)[0], more, identity=ident, session="more", namespace="a")
        assert store.shared is not None and not store.shared.tier.counters.get("denied")
    with persist.Store(tmp_path / "two", shared=alice, tier_key=key) as other:
        for name, want in [("mine", toks), ("more", more)]:
            got = other.restore(name, identity=ident, namespace="a")
            assert_same_state(live_state(got.cache), live_state(prefill(model, want)[0]))
        assert other.shared is not None and not other.shared.tier.counters.get("denied")
