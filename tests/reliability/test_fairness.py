"""Bounded work and fair tenants: lookups, repeated saves, budgets, per-namespace stats."""

from __future__ import annotations

from pathlib import Path

import pytest

import persist
from persist.storage import lookup
from tests.golden.cases import IDENTITY
from tests.golden.cases import kv_cache as kv

SYSTEM = list(range(1000, 2024))  # a 1,024-token system prompt: four full blocks


def chat(i: int) -> list[int]:
    return SYSTEM + [(i * 31 + k) % 900 for k in range(40)] + [i % 900, 901 + i % 50]


def compared(
    store: persist.Store, prompt: list[int], monkeypatch: pytest.MonkeyPatch, want: int = 1024
) -> int:
    """How many stored token lists a lookup compares with the prompt (its hit is ``want``)."""
    calls = []
    real = lookup.common_prefix_packed
    monkeypatch.setattr(lookup, "common_prefix_packed", lambda a, b: calls.append(1) or real(a, b))
    hit = store.lookup(prompt, identity=IDENTITY)
    monkeypatch.undo()
    assert hit is not None and len(hit.tokens) == want
    return len(calls)


# long: 18 s; tests/storage/test_scale.py counts the same lookups among 3,000 chats in the quick run
@pytest.mark.long
def test_lookup_work_does_not_grow_with_sessions_sharing_a_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 chats share a 1,024-token system prompt: a lookup compares a bounded few."""
    work = {}
    for n in (20, 2000):
        with persist.Store(tmp_path / f"s{n}") as s:
            base = kv(len(chat(0)), 1)
            for i in range(n):
                s.save([base], chat(i), identity=IDENTITY, session=f"chat{i}")
            new_chat = SYSTEM + [899, 3, 4]
            best = max(len(SYSTEM) + (chat(i)[1024] == 899) for i in range(n))  # 899 3 4: 1 more
            work[n] = compared(s, new_chat, monkeypatch, want=best)
            # a chat continuing an old one finds its own session among the 2,000
            own = compared(s, chat(7)[:1050] + [999], monkeypatch, want=1050)
            assert own <= 64
    assert work[2000] <= 64 and work[2000] <= 3 * max(work[20], 1) + 64, work


def test_identical_anonymous_saves_keep_one_entry(tmp_path: Path) -> None:
    toks = list(range(300))
    with persist.Store(tmp_path / "s") as s:
        for _ in range(25):
            s.save([kv(300, 2)], toks, identity=IDENTITY)
        assert len(s.entries()) == 1
        for n in (100, 200, 300):  # shorter prefixes a trimmable entry covers
            s.save([kv(n, 3)], toks[:n], identity=IDENTITY)
        s.save([kv(400, 4)], [*toks, *range(300, 400)], identity=IDENTITY)
        assert [e.tokens for e in s.entries()] == [400]
        assert s.check() == []


def test_namespace_stats_show_only_that_namespace(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s") as s:
        s.save([kv(300, 5)], list(range(300)), identity=IDENTITY, session="b", namespace="B")
        before = s.stats(namespace="B").to_dict()
        for i in range(5):  # tenant A saves, including B's very tokens
            s.save(
                [kv(300, 5)], list(range(300)), identity=IDENTITY, session=f"a{i}", namespace="A"
            )
        assert s.stats(namespace="B").to_dict() == before
        assert s.stats(namespace="A").unique_bytes == before["unique_bytes"]  # deduped in A
        assert s.stats().unique_bytes == 2 * before["unique_bytes"]


def test_a_tenant_budget_never_evicts_another_tenant(tmp_path: Path) -> None:
    one = kv(300, 6)
    with persist.Store(tmp_path / "probe") as p:
        size = p.save([one], list(range(300)), identity=IDENTITY, session="x").bytes
    with persist.Store(tmp_path / "s", namespace_max_bytes=3 * size) as s:
        s.save([one], list(range(300)), identity=IDENTITY, session="b", namespace="B")
        for i in range(10):
            toks = list(range(i * 1000, i * 1000 + 300))
            s.save([kv(300, 10 + i)], toks, identity=IDENTITY, session=f"a{i}", namespace="A")
        assert [e.session for e in s.sessions(namespace="B")] == ["b"]
        assert len(s.sessions(namespace="A")) == 3
        assert s.stats(namespace="A").unique_bytes <= 3 * size
        with pytest.raises(persist.StoreFullError):
            s.save(
                [kv(3000, 9)], list(range(3000)), identity=IDENTITY, session="big", namespace="A"
            )
        assert s.check() == []


def test_a_namespaces_partitions_share_its_budget(tmp_path: Path) -> None:
    """``NS/salt:X`` (persist serve's namespace for a request's cache_salt) counts against
    NS's budget: a tenant sending a new salt each time held one budget per salt (round 5
    attack).  Its own saves evict its own least recently used entries, in any partition."""
    one = kv(300, 6)
    with persist.Store(tmp_path / "probe") as p:
        size = p.save([one], list(range(300)), identity=IDENTITY, session="x").bytes
    with persist.Store(tmp_path / "s", namespace_max_bytes=3 * size) as s:
        s.save([one], list(range(300)), identity=IDENTITY, session="b", namespace="B")
        for i in range(10):
            toks = list(range(i * 1000, i * 1000 + 300))
            s.save([kv(300, 10 + i)], toks, identity=IDENTITY, session="a", namespace=f"A/salt:{i}")
        kept = [i for i in range(10) if s.sessions(namespace=f"A/salt:{i}")]
        assert kept == [7, 8, 9]  # the three most recent, one budget for all of A
        assert [e.session for e in s.sessions(namespace="B")] == ["b"]
        assert s.check() == []


def test_hints_order_eviction_across_a_namespaces_partitions(tmp_path: Path) -> None:
    """A hinted entry in one partition outlives plain ones in the others, and its hint
    never lets the partitions together hold more than their one budget."""
    one = kv(300, 6)
    with persist.Store(tmp_path / "probe") as p:
        size = p.save([one], list(range(300)), identity=IDENTITY, session="x").bytes
    with persist.Store(tmp_path / "s", namespace_max_bytes=3 * size) as s:
        for i in range(10):
            toks = list(range(i * 1000, i * 1000 + 300))
            ttl = 3600.0 if i == 0 else None  # protected for an hour: evicted last
            ns = f"A/salt:{i}"
            s.save([kv(300, 10 + i)], toks, identity=IDENTITY, session="a", namespace=ns, ttl=ttl)
        kept = [i for i in range(10) if s.sessions(namespace=f"A/salt:{i}")]
        assert kept == [0, 8, 9]
        held = sum(s.stats(namespace=f"A/salt:{i}").unique_bytes for i in kept)
        assert held <= 3 * size


def test_store_eviction_agrees_with_the_policy_rule(tmp_path: Path) -> None:
    """The store evicts one SQL victim at a time; ``policy.plan_eviction`` is the rule."""
    import random

    from persist import policy

    rng = random.Random(4)
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        shared = list(range(64))  # four shared blocks
        for i in range(12):
            toks = shared[: rng.choice([0, 32, 64])] + [1000 + i] * rng.randrange(20, 80)
            s.save([kv(len(toks), 40 + i)], toks, identity=IDENTITY, session=f"s{i}", pin=i == 3)
        for e in s.entries():  # shuffle recency
            s.index.db.execute("UPDATE snapshots SET used = ? WHERE id = ?", [rng.random(), e.id])
        db = s.index.db
        refs: dict[int, list[str]] = {}
        for sid, f in db.execute(
            "SELECT snapshot, blob FROM snapshot_blocks WHERE blob IS NOT NULL"
        ):
            refs.setdefault(sid, []).append(f)
        entries = [
            policy.EvictEntry(sid, used, bool(pinned), (tail, *refs.get(sid, [])))
            for sid, used, pinned, tail in db.execute(
                "SELECT id, used, pinned, tail FROM snapshots"
            )
        ]
        sizes = dict(db.execute("SELECT file, size FROM blobs WHERE dead = 0").fetchall())
        budget = s.stats().unique_bytes // 3
        want = policy.plan_eviction(entries, sizes, budget)
        got = [e.id for e in s.gc(budget, dry_run=True).evicted]
        assert got == want and len(want) > 2
