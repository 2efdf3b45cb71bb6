"""The host-RAM tier (engine.host_tier): budget, LRU by bytes, fresh copies, bit-exact;
a keep that fails inside mlx-lm's eviction, or a lookup beside a close, never breaks
the server, and tenants sharing one tier never see each other's caches (cases from
attacks on the host tier)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

import persist
from persist.engine.host.placement import default_budget
from persist.engine.host.store_hooks import from_host
from persist.engine.host.tier import HostTier
from persist.errors import InvalidArgumentError, InvalidStateError, PersistError
from persist.identity import ModelIdentity
from persist.serve.server import PersistentPromptCache
from tests.helpers import prefill, tokens_for

PROMPT = list(range(3, 40))


def prefilled(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([a for c in cache for a in c.state if isinstance(a, mx.array)])
    return cache


def states(cache: list[Any]) -> list[np.ndarray]:
    # what a layer holds: its live positions (the buffer past offset is spare room)
    arrays = [a[..., : c.offset, :] for c in cache for a in (c.keys, c.values)]
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in arrays]


def test_hit_is_bit_exact_and_a_fresh_copy(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    kept = prefilled(model, PROMPT[:20])
    want = states(kept)
    tier = HostTier(1 << 30)
    assert tier.keep("m", PROMPT[:20], kept)
    hit = tier.fetch("m", PROMPT)
    assert hit is not None and hit.tokens == PROMPT[:20]
    assert all((a == b).all() for a, b in zip(states(hit.cache), want, strict=True))
    # continuing the restored copy in place must not touch the kept entry
    model(mx.array(PROMPT[20:])[None], cache=hit.cache)
    mx.eval([a for c in hit.cache for a in c.state if isinstance(a, mx.array)])
    again = tier.fetch("m", PROMPT)
    assert again is not None
    assert all((a == b).all() for a, b in zip(states(again.cache), want, strict=True))
    # and the continuation equals a fresh prefill of the whole prompt
    fresh = prefilled(model, PROMPT)
    got = model(mx.array([7])[None], cache=hit.cache)
    ref = model(mx.array([7])[None], cache=fresh)
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)))


def test_lookup_rules(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    tier = HostTier(1 << 30)
    tier.keep("m", PROMPT[:10], prefilled(model, PROMPT[:10]))
    twenty = prefilled(model, PROMPT[:20])
    tier.keep("m", PROMPT[:20], twenty)
    assert tier.fetch("other", PROMPT) is None  # another model's caches never match
    # a trimmable cache serves the part it shares, one token at least left over
    assert tier.fetch("m", PROMPT[:20]).tokens == PROMPT[:19]  # type: ignore[union-attr]
    turn = tier.fetch("m", [*PROMPT[:15], 999, 998])
    assert turn is not None and turn.tokens == PROMPT[:15]
    # bit-exact: the kept cache's first 15 positions (a 20-token forward's numbers)
    want = [a[..., :15, :] for a in states(twenty)]
    assert all((a == b).all() for a, b in zip(states(turn.cache), want, strict=True))
    assert tier.fetch("m", PROMPT, longer_than=20) is None  # memory has as much
    assert tier.fetch("m", [9, 9, 9]) is None
    assert tier.stats()["hits"] == 2 and tier.stats()["misses"] == 3


def test_budget_and_lru_by_bytes(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    caches = [prefilled(model, PROMPT[:n]) for n in (10, 10, 10)]
    size = int(sum(c.nbytes for c in caches[0]))
    tier = HostTier(2 * size)
    tier.keep("m", [1, *PROMPT[:9]], caches[0])
    tier.keep("m", [2, *PROMPT[:9]], caches[1])
    assert tier.fetch("m", [1, *PROMPT[:9], 5]) is not None  # 1 is now the most recent
    tier.keep("m", [3, *PROMPT[:9]], caches[2])  # over budget: 2, the least recent, goes
    assert tier.nbytes == 2 * size and len(tier) == 2 and tier.stats()["evicted"] == 1
    assert tier.fetch("m", [2, *PROMPT[:9], 5]) is None
    assert tier.fetch("m", [1, *PROMPT[:9], 5]) is not None
    assert not HostTier(size - 1).keep("m", PROMPT[:10], caches[0])  # never fits: not kept
    assert len(HostTier(0)) == 0


def test_bad_budget_is_typed() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        HostTier(-1)
    assert isinstance(e.value, PersistError) and isinstance(e.value, ValueError)


def test_default_budget(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 1000 kB\nMemAvailable:    1048576 kB\n")
    assert default_budget(str(info)) == (1 << 30) // 10
    info.write_text("MemAvailable: 1048576000 kB\n")
    assert default_budget(str(info)) == 8 << 30


def recurrent(cache: list[Any]) -> list[Any]:
    """The recurrent layers' arrays, as views of their buffers (bfloat16 as uint16)."""
    out = []
    for c in cache:
        for a in getattr(c, "cache", None) or []:
            if a is not None:
                v = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
                mx.eval(v)
                out.append(np.asarray(memoryview(v)))
    return out


def test_a_hit_shares_no_memory_with_the_entry(tiny: Any) -> None:
    """``copy.deepcopy`` of an ``mx.array`` shares its buffer: a hit written through a
    memoryview (or by a kernel that writes in place) must not reach the kept entry."""
    model, _, _ = tiny("qwen3_next")  # recurrent layers: their state is decoded as it is
    kept = prefilled(model, PROMPT[:20])
    want = [a.copy() for a in recurrent(kept)]
    assert want
    tier = HostTier(1 << 30)
    assert tier.keep("m", PROMPT[:20], kept)
    hit = tier.fetch("m", PROMPT)
    assert hit is not None
    for a in recurrent(hit.cache):
        a[...] = 0
    again = tier.fetch("m", PROMPT)
    assert again is not None
    got = recurrent(again.cache)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


IDENT = ModelIdentity("llama", "c", "w", "t", "ct")


class UnknownCache(KVCache):  # a model's own cache class persist has no codec for
    pass


def _unknown() -> list[Any]:
    c = UnknownCache()
    c.update_and_fetch(mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4)))
    return [c]


def test_a_keep_that_fails_in_an_eviction_never_reaches_mlx_lm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A keep that raised inside mlx-lm's eviction left its byte count wrong and failed
    every later insert (persist serve answered 503, then exited)."""
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(2, 40000, store=store, identity=IDENT, host=HostTier(1 << 30))
        try:
            with caplog.at_level(logging.WARNING, logger="persist"):
                for i in range(6):
                    pc.insert_cache("m", [i] * 8 + [1, 2], _unknown())
                pc.flush()  # the keeper thread's keeps (and their warnings) are done
            assert len(pc) == 2 and pc.nbytes == 2 * sum(c.nbytes for c in _unknown())
            assert "could not keep an evicted cache" in caplog.text
        finally:
            pc.close()


def test_a_lookup_beside_a_close_is_a_typed_error(tmp_path: Path) -> None:
    class Closing:
        index = persist.Store(tmp_path / "s").index
        costs = None
        host = None  # the close dropped the tier between host_hit() and from_host()
        blobs = None
        block_tokens = 16
        strict_backend = False

    with pytest.raises(InvalidStateError, match="closed"):
        from_host(
            Closing(),  # type: ignore[arg-type]
            None,
            [1, 2, 3],
            identity=IDENT,
            namespace="default",
            who="who",
            longer_than=0,
            max_cost=None,
        )


def test_a_shared_host_tier_keeps_tenants_apart(tiny: Any, tmp_path: Path) -> None:
    """Two tenants' prompt caches over one RAM budget (the README's library server)."""
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    a_toks, b_toks = tokens_for(60, seed=1), tokens_for(60, seed=2)
    host = HostTier(1 << 30)
    with persist.Store(tmp_path / "store") as store:
        a = PersistentPromptCache(1, store=store, identity=identity, namespace="a", host=host)
        b = PersistentPromptCache(1, store=store, identity=identity, namespace="b", host=host)
        try:
            a.insert_cache("m", a_toks, prefill(model, a_toks)[0])
            a.insert_cache("m", b_toks, prefill(model, b_toks)[0])  # a_toks evicted to RAM
            a.flush()
            assert store.lookup([*a_toks, 1], identity=identity, namespace="b") is None
            cache, rest = b.fetch_nearest_cache("m", [*a_toks, 1])
            # tenant b never sent these tokens: nothing of tenant a's may answer it
            assert cache is None and len(rest) == 61
        finally:
            a.close()
            b.close()


def _held(tier: HostTier, owner: str, firsts: range) -> list[int]:
    """Which of ``owner``'s entries ``[f, *PROMPT[:19]]`` the tier holds (no recency kept)."""
    return [f for f in firsts if tier.peek(owner, [f, *PROMPT[:19], 0])[0] == 20]


def _keep(tier: HostTier, model: Any, owner: str, first: int) -> bool:
    toks = [first, *PROMPT[:19]]
    return tier.keep(owner, toks, prefilled(model, toks))


def test_a_keep_over_the_tier_evicts_its_own_tenant_first(tiny: Any) -> None:
    """Round 5 attack: a tenant's burst, each keep within its share, evicted the others'
    entries least recently used tier-wide; its own go first, as in the store."""
    model, _, _ = tiny("llama")
    size = int(sum(c.nbytes for c in prefilled(model, PROMPT[:20])))
    tier = HostTier(6 * size)
    tier.owner_max_bytes = 4 * size
    for f in (100, 101):
        assert _keep(tier, model, "bob", f)
    for f in range(6):  # alice bursts past what the tier has left
        assert _keep(tier, model, "alice", f)
    assert _held(tier, "bob", range(100, 102)) == [100, 101]
    assert _held(tier, "alice", range(6)) == [2, 3, 4, 5]


def test_a_full_tier_takes_from_the_largest_holder_never_a_smaller_one(tiny: Any) -> None:
    """Within their shares the tenants fill the tier; a keep then evicts the least recently
    used entry of whoever holds most (the keeper on a tie): a tenant can push others down
    to its own holding, never below, however old their entries."""
    model, _, _ = tiny("llama")
    size = int(sum(c.nbytes for c in prefilled(model, PROMPT[:20])))
    tier = HostTier(6 * size)
    tier.owner_max_bytes = 4 * size
    for f in (200, 201):  # carol's are the oldest in the tier
        assert _keep(tier, model, "carol", f)
    for f in range(100, 104):
        assert _keep(tier, model, "bob", f)
    for f in range(3):
        assert _keep(tier, model, "alice", f)
    assert _held(tier, "carol", range(200, 202)) == [200, 201]
    assert _held(tier, "bob", range(100, 104)) == [102, 103]
    assert _held(tier, "alice", range(3)) == [1, 2]  # at a tie, her own oldest went


def test_a_tenants_salts_share_its_host_budget(tiny: Any) -> None:
    """Round 5 attack: each cache_salt's namespace had a share of its own in the host
    tier too.  A share is the tenant's (``storage.retention.budget_owner``), across its
    salts and models."""
    from persist.engine.host.store_hooks import owner

    model, _, _ = tiny("llama")
    size = int(sum(c.nbytes for c in prefilled(model, PROMPT[:20])))
    tier = HostTier(100 * size)
    tier.owner_max_bytes = 2 * size
    bob = owner("default/tenant:bob", IDENT, False)
    assert _keep(tier, model, bob, 100)
    salted = [owner(f"default/tenant:alice/salt:{i:032x}", IDENT, False) for i in range(5)]
    for i, who in enumerate(salted):
        assert _keep(tier, model, who, i)
    assert [i for i, who in enumerate(salted) if _held(tier, who, range(i, i + 1))] == [3, 4]
    assert _held(tier, bob, range(100, 101)) == [100]


def test_one_owner_cannot_evict_the_others(tiny: Any) -> None:
    """persist serve --tenant-max-bytes: an owner (a tenant's namespace) past its share
    evicts its own entries, least recently used first; the others' stay."""
    model, _, _ = tiny("llama")
    one = prefilled(model, PROMPT[:20])
    size = int(sum(c.nbytes for c in one))
    tier = HostTier(100 * size)
    tier.owner_max_bytes = 2 * size
    assert tier.keep("bob", PROMPT[:20], one)
    for i in range(5):  # alice keeps five, distinct
        assert tier.keep("alice", [50 + i, *PROMPT[:19]], prefilled(model, [50 + i, *PROMPT[:19]]))
    assert tier.fetch("bob", PROMPT) is not None
    alice = [i for i in range(5) if tier.fetch("alice", [50 + i, *PROMPT]) is not None]
    assert alice == [3, 4]  # her two most recent
    long = tokens_for(600)  # three of KVCache's 256-token steps: past any owner's share
    assert not tier.keep("carol", long, prefilled(model, long))


def test_a_host_copy_is_made_only_when_it_is_the_longest(tiny: Any, tmp_path: Path) -> None:
    # One order for every tier (engine.lookup_order): the host tier is peeked at
    # first and copied last, so a store hit that is longer costs no RAM copy.
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(90, seed=94)
    with persist.Store(tmp_path / "s") as store:
        host = HostTier(1 << 30)
        pc = PersistentPromptCache(2, store=store, identity=ident, host=host)
        try:
            host.keep(pc._owner(ident, "default"), toks[:40], prefill(model, toks[:40])[0])
            store.save(prefill(model, toks[:70])[0], toks[:70], identity=ident)
            cache, rest = pc.fetch_nearest_cache("m", toks[:80])
            assert cache is not None and rest == toks[70:80]
            assert host.hits == 0 and pc.counters["store_hits"] == 1
            cache, rest = pc.fetch_nearest_cache("m", [*toks[:40], 1, 2])  # the host's own
            assert cache is not None and rest == [1, 2] and host.hits == 1
        finally:
            pc.close()
