"""The host-RAM tier evicts in the store's order (``policy.eviction_key``): retention
hints keep an agent's prefix through a burst of one-off prompts, lapse, order by
priority, travel with the entry that covers a hinted one, and never let an owner (a
tenant) hold more than its share.  Real mlx-lm KV caches, an injected wall clock."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine.host.eviction import order
from persist.engine.host.tier import HostTier
from tests.golden.cases import IDENTITY
from tests.golden.cases import kv_cache as kv

N = 32  # tokens an entry holds


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def toks(seed: int, n: int = N) -> list[int]:
    return [seed * 1000 + k for k in range(n)]


def tier_for(entries: int) -> tuple[HostTier, Clock]:
    """A tier whose budget holds ``entries`` entries of N tokens, on an injected clock."""
    probe = HostTier(1 << 30)
    probe.keep("m", toks(99), [kv(N, 99)], copy=True)
    tier = HostTier(probe.nbytes * entries)
    clock = Clock()
    tier.now = clock
    return tier, clock


def keep(tier: HostTier, seed: int, owner: str = "m", **kw: Any) -> bool:
    return tier.keep(owner, toks(seed), [kv(N, seed)], copy=True, **kw)


def held(tier: HostTier, owner: str = "m") -> set[int]:
    """The seeds whose entries the tier holds."""
    return {key[1][0] // 1000 for key in tier._entries if key[0] == owner}


def test_an_agent_prefix_with_a_ttl_outlives_a_burst_of_one_offs() -> None:
    tier, clock = tier_for(3)
    keep(tier, 1, hints=(3600.0, 0))  # the agent's system prompt and tools
    for seed in range(2, 9):  # one-off prompts, each newer than the agent's
        clock.t += 10
        keep(tier, seed)
    assert held(tier) == {1, 7, 8}
    plain, _ = tier_for(3)
    for seed in range(1, 9):
        keep(plain, seed)
    assert held(plain) == {6, 7, 8}  # without the hint, LRU: the agent's went first


def test_a_lapsed_ttl_is_plain_lru_again() -> None:
    tier, clock = tier_for(2)
    keep(tier, 1, hints=(60.0, 0))
    clock.t += 3600  # its minute is long over
    keep(tier, 2)
    keep(tier, 3)
    assert held(tier) == {2, 3}


def test_a_hit_renews_the_ttl() -> None:
    tier, clock = tier_for(2)
    keep(tier, 1, hints=(60.0, 0))
    clock.t += 50
    assert tier.fetch("m", [*toks(1), 5]) is not None  # used again: 60 s from now
    clock.t += 50
    keep(tier, 2)
    keep(tier, 3)
    assert held(tier) == {1, 3}


def test_priority_orders_and_the_budget_still_wins() -> None:
    tier, _ = tier_for(2)
    keep(tier, 1, hints=(3600.0, 5))
    keep(tier, 2, hints=(3600.0, -1))
    keep(tier, 3, hints=(3600.0, 0))  # every entry protected: priority decides
    assert held(tier) == {1, 3}
    keep(tier, 4)  # unhinted, but the entry being kept is never its own victim
    assert held(tier) == {1, 4}


def test_an_owner_never_holds_more_than_its_share_whatever_its_hints() -> None:
    tier, _ = tier_for(10)
    tier.owner_max_bytes = tier.max_bytes // 5  # two entries each
    for seed in range(1, 5):
        keep(tier, seed, "a", hints=(3600.0, 1000))
    keep(tier, 50, "b")
    assert len(held(tier, "a")) == 2 and held(tier, "b") == {50}
    assert sum(k.nbytes for key, k in tier._entries.items() if key[0] == "a") <= (
        tier.owner_max_bytes
    )


def test_the_entry_that_covers_a_hinted_one_keeps_its_hints() -> None:
    tier, clock = tier_for(3)
    keep(tier, 1, hints=(3600.0, 3))  # the agent's prefix
    longer = [*toks(1), *range(500, 516)]
    assert tier.keep("m", longer, [kv(N + 16, 1)], copy=True)  # a turn that covers it
    assert len(tier) == 1
    (kept,) = tier._entries.values()
    assert (kept.ttl, kept.priority) == (3600.0, 3)
    for seed in (2, 3):
        clock.t += 10
        keep(tier, seed)
    assert held(tier) == {1, 3}  # 2 went, not the older (hinted) turn
    assert tier.fetch("m", [*toks(1), 7]) is not None  # the prefix still serves


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_eviction_order_is_the_policy_rule(seed: int) -> None:
    rng = random.Random(seed)
    tier, clock = tier_for(40)
    for s in range(1, 13):
        clock.t += rng.uniform(0, 100)
        hints = rng.choice([None, (50.0, 0), (0.0, rng.randrange(-2, 3)), (5000.0, 1)])
        keep(tier, s, hints=hints)
        if rng.random() < 0.3:  # a hit: used again
            tier.fetch("m", [*toks(rng.randrange(1, s + 1)), 9])
    clock.t += 60
    entries = tier._entries
    keys = {k[1][0] // 1000: order(e, clock.t) for k, e in entries.items()}
    assert {k[0] for k in keys.values()} == {True, False}  # protected and lapsed both
    want = sorted(keys, key=lambda s: keys[s])
    got = []
    while len(tier):
        before = held(tier)
        tier._evict_oldest()
        got += sorted(before - held(tier))
    assert got == want


def test_a_store_keeps_its_hints_in_the_host_tier(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", block_tokens=16, host_cache=1 << 30) as s:
        assert s.host is not None
        s.save([kv(N, 1)], toks(1), identity=IDENTITY, ttl=3600, priority=4)
        s.save([kv(N, 2)], toks(2), identity=IDENTITY)
        got = {key[1][0] // 1000: (k.ttl, k.priority) for key, k in s.host._entries.items()}
        assert got == {1: (3600.0, 4), 2: (0.0, 0)}
