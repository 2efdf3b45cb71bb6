"""``Store.warm``: a reopened store reads its most valuable entries into the host
tier, and their first lookups are served from RAM, bit for bit what was saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.errors import InvalidArgumentError
from tests.helpers import assert_same_state, live_state, prefill, tokens_for


def saved_chats(tiny: Any, root: Path) -> tuple[Any, persist.ModelIdentity, list[list[int]]]:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    chats = [tokens_for(64, seed) for seed in (1, 2, 3)]
    with persist.Store(root) as store:
        for i, toks in enumerate(chats):
            store.save(prefill(model, toks, step=64)[0], toks, identity=identity, session=f"c{i}")
        store.pin("c0")  # pinned: warmed before any recency
    return model, identity, chats


def test_warm_start_serves_the_most_valuable_from_ram(tiny: Any, tmp_path: Path) -> None:
    model, identity, chats = saved_chats(tiny, tmp_path / "s")
    with persist.Store(tmp_path / "s", host_cache=64 << 20) as store:
        report = store.warm(identity, 2)
        assert (report.entries, report.tokens, report.skipped) == (2, 128, 0)
        for i, toks in ((0, chats[0]), (2, chats[2])):  # pinned c0 and the latest, c2
            hit = store.lookup(toks + [7], identity=identity, max_cost=float("inf"))
            assert hit is not None and hit.source == "host", i
            assert_same_state(live_state(hit.cache), live_state(prefill(model, toks, step=64)[0]))
        hit = store.lookup(chats[1] + [7], identity=identity, max_cost=float("inf"))
        assert hit is not None and hit.source != "host"  # not warmed: read from the store


def test_warm_reads_no_more_than_the_tier_holds(tiny: Any, tmp_path: Path) -> None:
    _, identity, _ = saved_chats(tiny, tmp_path / "s")
    with persist.Store(tmp_path / "s") as plain:
        one = max(e.bytes for e in plain.entries())
    with persist.Store(tmp_path / "s", host_cache=one + one // 2) as store:
        assert store.warm(identity, 3).entries == 1


def test_warm_of_another_model_reads_nothing(tiny: Any, tmp_path: Path) -> None:
    saved_chats(tiny, tmp_path / "s")
    model, tok, _ = tiny("llama")
    other = persist.ModelIdentity.of(model, tok, max_kv_size=4096)
    with persist.Store(tmp_path / "s", host_cache=64 << 20) as store:
        assert store.warm(other, 3).entries == 0


def test_warm_needs_a_host_tier_and_a_count(tiny: Any, tmp_path: Path) -> None:
    _, identity, _ = saved_chats(tiny, tmp_path / "s")
    with persist.Store(tmp_path / "s") as store, pytest.raises(InvalidArgumentError):
        store.warm(identity, 2)
    with (
        persist.Store(tmp_path / "s", host_cache=1 << 20) as s,
        pytest.raises(InvalidArgumentError),
    ):
        s.warm(identity, -1)


def test_warm_takes_hinted_entries_before_recent_ones(tiny: Any, tmp_path: Path) -> None:
    _, identity, chats = saved_chats(tiny, tmp_path / "s")
    with persist.Store(tmp_path / "s", host_cache=64 << 20) as store:
        store.pin("c0", pinned=False)
        store.retain("c1", ttl=3600, priority=2)  # older than c2, but hinted
        assert store.warm(identity, 1).entries == 1
        assert store.host is not None
        ((_, kept),) = store.host._entries.items()
        assert len(kept.tokens) == 64 and (kept.ttl, kept.priority) == (3600.0, 2)
        hit = store.lookup(chats[1] + [7], identity=identity, max_cost=float("inf"))
        assert hit is not None and hit.source == "host"
