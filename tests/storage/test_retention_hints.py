"""Retention hints (ttl, priority) order eviction within a budget, and never exceed it.

Real SQLite stores of real mlx-lm KV caches; the SQL victim order is checked
against the pure rule, ``policy.eviction_key``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

import persist
from persist import policy
from persist.errors import InvalidArgumentError, SessionNotFoundError
from tests.golden.cases import IDENTITY
from tests.golden.cases import kv_cache as kv


def save(s: persist.Store, name: str, seed: int, **hints: Any) -> persist.EntryInfo:
    toks = [seed * 1000 + k for k in range(64)]
    return s.save([kv(64, seed)], toks, identity=IDENTITY, session=name, **hints)


def aged(s: persist.Store, name: str, seconds_ago: float) -> None:
    """Last used ``seconds_ago`` (``used`` is not in the row checksum)."""
    s.index.db.execute(
        "UPDATE snapshots SET used = ? WHERE name = ?", [time.time() - seconds_ago, name]
    )


def test_an_agent_prefix_with_a_ttl_outlives_a_burst_of_one_offs(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        size = save(s, "agent", 1, ttl=3600).bytes
        aged(s, "agent", 600)  # the oldest entry: plain LRU would evict it first
        s.budgets = persist_budget(size * 3)
        for i in range(2, 8):  # a burst of one-off prompts, each newer than the agent's
            save(s, f"once{i}", i)
        names = {e.session for e in s.sessions()}
        assert "agent" in names and len(names) == 3
        assert s.check() == []


def test_a_lapsed_ttl_is_plain_lru_again(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        size = save(s, "agent", 1, ttl=60).bytes
        aged(s, "agent", 3600)  # last used an hour ago: its minute is long over
        s.budgets = persist_budget(size * 2)
        save(s, "a", 2)
        save(s, "b", 3)
        assert {e.session for e in s.sessions()} == {"a", "b"}


def test_priority_orders_and_the_budget_still_wins(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        size = save(s, "high", 1, priority=5, ttl=3600).bytes
        save(s, "low", 2, priority=-1, ttl=3600)
        s.budgets = persist_budget(size * 2)
        save(s, "new", 3, ttl=3600)  # everything is protected: the budget decides
        assert {e.session for e in s.sessions()} == {"high", "new"}
        s.budgets = persist_budget(size)
        save(s, "newest", 4, ttl=3600)  # over budget with only protected entries left
        assert {e.session for e in s.sessions()} == {"newest"}


def test_a_session_keeps_its_hints_from_turn_to_turn(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        save(s, "agent", 1, ttl=3600, priority=2)
        toks = [1000 + k for k in range(64)] + [7] * 16
        s.save([kv(80, 1)], toks, identity=IDENTITY, session="agent")  # no hints given
        got = s.index.db.execute(
            "SELECT ttl, priority FROM retention_hints JOIN snapshots ON id = snapshot"
            " WHERE name = 'agent'"
        ).fetchall()
        assert got == [(3600.0, 2)]
        s.retain("agent")  # neither given: cleared
        rows = s.index.db.execute("SELECT count(*) FROM retention_hints").fetchone()
        assert rows[0] == 0 and s.check() == []


def test_hints_are_checked(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        save(s, "a", 1)
        for bad in ({"ttl": -1.0}, {"ttl": float("inf")}, {"ttl": "1h"}, {"priority": 1.5},
                    {"priority": 10**6}, {"ttl": True}):  # fmt: skip
            with pytest.raises(InvalidArgumentError):
                s.retain("a", **bad)
            with pytest.raises(InvalidArgumentError):
                save(s, "b", 2, **bad)
        with pytest.raises(SessionNotFoundError):
            s.retain("nobody", ttl=60)
        assert [e.session for e in s.sessions()] == ["a"]


def test_sql_eviction_agrees_with_the_policy_rule(tmp_path: Path) -> None:
    rng = random.Random(7)
    now = time.time()
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        for i in range(14):
            hints = rng.choice([{}, {"ttl": 100.0}, {"priority": rng.randrange(-2, 3)},
                                {"ttl": 5000.0, "priority": 1}])  # fmt: skip
            save(s, f"s{i}", i + 1, **hints)
            aged(s, f"s{i}", rng.uniform(0, 1000))
        db = s.index.db
        hints_of = {sid: (t, p) for sid, t, p in db.execute("SELECT * FROM retention_hints")}
        refs: dict[int, list[str]] = {}
        blocks = "SELECT snapshot, blob FROM snapshot_blocks WHERE blob IS NOT NULL"
        for sid, f in db.execute(blocks):
            refs.setdefault(sid, []).append(f)
        entries = []
        for sid, used, pin, tail in db.execute("SELECT id, used, pinned, tail FROM snapshots"):
            ttl, prio = hints_of.get(sid, (0.0, 0))
            entries.append(
                policy.EvictEntry(
                    sid, used, bool(pin), (tail, *refs.get(sid, [])), ttl=ttl, priority=prio
                )
            )
        sizes = dict(db.execute("SELECT file, size FROM blobs WHERE dead = 0").fetchall())
        budget = s.stats().unique_bytes // 4
        want = policy.plan_eviction(entries, sizes, budget, now=time.time())
        got = [e.id for e in s.gc(budget, dry_run=True).evicted]
        assert got == want and len(want) > 3
        # the case exercises every part of the key: protected, prioritized and plain
        keys = [policy.eviction_key(e, now) for e in entries]
        assert {k[0] for k in keys} == {True, False} and len({k[1] for k in keys}) > 2


def persist_budget(n: int) -> Any:
    from persist.storage.retention import Budgets

    return Budgets(max_bytes=n)


def test_a_prefix_that_covers_a_hinted_one_keeps_its_hints(tmp_path: Path) -> None:
    """An anonymous prefix saved with hints (a server's agent prefix) is replaced by the
    longer entry that covers it (its next turn): that one serves the prefix now."""
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        toks = [1000 + k for k in range(64)]
        s.save([kv(64, 1)], toks, identity=IDENTITY, ttl=3600, priority=2)
        s.save([kv(80, 1)], [*toks, *range(16)], identity=IDENTITY)  # covers it
        got = s.index.db.execute(
            "SELECT n_tokens, ttl, priority FROM snapshots JOIN retention_hints ON id = snapshot"
        ).fetchall()
        assert got == [(80, 3600.0, 2)]
        assert s.check() == []


def test_a_pinned_prefix_is_not_replaced_by_the_longer_entry_that_covers_it(
    tmp_path: Path,
) -> None:
    """Outside attack r15, F3: a pinned anonymous prefix was replaced by the unpinned
    entry that covers it (its pin was not passed on, hints were) and gc then evicted
    that one: the pinned prefix was gone.  Only unpinning ends a pin, so a pinned entry
    is never covered away; the longer one is kept beside it, unpinned."""
    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        toks = [1000 + k for k in range(64)]
        pinned = s.save([kv(64, 1)], toks, identity=IDENTITY, pin=True)
        s.save([kv(80, 1)], [*toks, *range(16)], identity=IDENTITY)  # covers it
        s.gc(max_bytes=0)
        kept = [(e.id, e.tokens, e.pinned) for e in s.entries()]
        assert kept == [(pinned.id, 64, True)]
        hit = s.lookup([*toks, 5], identity=IDENTITY)
        assert hit is not None and hit.entry.id == pinned.id and hit.tokens == toks
        assert s.check() == []


def test_a_save_over_a_namespace_budget_names_that_budget(tmp_path: Path) -> None:
    # attack r15: "the store budget is 50000 bytes" for a namespace's budget of 50000
    from persist.storage.retention import Budgets

    with persist.Store(tmp_path / "s", block_tokens=16) as s:
        s.budgets = Budgets(max_bytes=None, per_namespace={"team": 1000})
        with pytest.raises(persist.StoreFullError, match=r"namespace 'team'.s budget is 1000"):
            s.save([kv(64, 1)], list(range(64)), identity=IDENTITY, namespace="team")
        s.budgets = Budgets(max_bytes=1000)
        with pytest.raises(persist.StoreFullError, match=r"the store's budget is 1000"):
            s.save([kv(64, 1)], list(range(64)), identity=IDENTITY, namespace="team")
        assert list(s.entries(namespace="team")) == []
