"""A request's statistics never write the index on mlx-lm's generation thread (issue 39):
counters and last uses wait in memory (``Index.hold_statistics``) and prefill rates
in a queue, and persist serve's stats thread writes them.  Real tiny model, real
SQLite file; which thread began a write transaction is read from SQLite's own trace."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import persist
from persist.serve.server import PersistentPromptCache
from persist.serve.stats_writer import StatsWriter
from tests.helpers import prefill, tokens_for


def _writes_by_thread(store: persist.Store) -> list[int]:
    """The thread of every write transaction the store's connection begins from now."""
    writers: list[int] = []

    def trace(sql: str) -> None:
        if sql.strip().upper().startswith("BEGIN IMMEDIATE"):
            writers.append(threading.get_ident())

    store.index.db.conn.set_trace_callback(trace)
    return writers


def test_a_miss_and_a_memory_hit_write_nothing_on_the_requests_thread(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks, other = tokens_for(80, seed=95), tokens_for(80, seed=96)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            pc.insert_cache("m", toks, prefill(model, toks)[0])
            pc.flush()
            writers = _writes_by_thread(store)
            cache, _ = pc.fetch_nearest_cache("m", other)  # a miss in every tier
            assert cache is None
            cache, _ = pc.fetch_nearest_cache("m", [*toks, 1])  # memory answers
            assert cache is not None
            assert threading.get_ident() not in writers
            pc.flush()  # the stats thread writes what was counted
            assert writers and threading.get_ident() not in writers
            counts = store.stats().counters
            assert counts["serve_misses"] == 1 and counts["serve_memory_hits"] == 1
        finally:
            pc.close()
    with persist.Store(tmp_path / "s") as again:  # written, not only held in memory
        assert again.stats().counters["serve_misses"] == 1


def test_a_store_hit_writes_nothing_on_the_requests_thread(tiny: Any, tmp_path: Path) -> None:
    """A hit from the store: its restore-or-recompute decision and its measured restore
    rate were two more transactions (each an fsync, behind the write-behind's commits)
    on the generation thread, before the first token."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(80, seed=98)
    with persist.Store(tmp_path / "s") as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="a")
        for _ in range(3):  # the prefill rates: the hit faces a real decision
            store.record_prefill(ident, 0, 80, 1.0)
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            writers = _writes_by_thread(store)
            cache, rest = pc.fetch_nearest_cache("m", [*toks, 1])  # from the store
            assert cache is not None and len(rest) == 1
            assert threading.get_ident() not in writers
            pc.flush()
            assert writers and threading.get_ident() not in writers
            stats = store.stats()
            assert stats.decisions and stats.decisions[0]["restore"] is True
            assert any(r["what"].startswith("restore") for r in stats.rates)
        finally:
            pc.close()
    with persist.Store(tmp_path / "s") as again:  # written, not only held in memory
        assert again.stats().decisions


def test_held_statistics_are_written_by_close_and_read_while_held(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s") as store:
        store.index.hold_statistics()
        store.count("ns", lookups=2)
        store.count("ns", lookups=1)
        assert store.index.counters("ns") == {"lookups": 3}  # this process sees them
        with persist.Store(tmp_path / "s") as other:  # another opener does not, yet
            assert other.index.counters("ns") == {}
    with persist.Store(tmp_path / "s") as store:  # close wrote them
        assert store.index.counters("ns") == {"lookups": 3}


def test_a_held_last_use_is_written_and_never_moves_back(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=97)
    with persist.Store(tmp_path / "s") as store:
        info = store.save(prefill(model, toks)[0], toks, identity=ident, session="a")
        store.index.hold_statistics()
        store.index.touch(info.id)
        held = store.index.held
        assert held is not None and set(held.used) == {info.id}
        later = held.used[info.id]
        held.used[info.id] = 1.0  # an older use than the row's: the row keeps its own
        store.index.write_statistics()
        assert held.used == {}
        used = store.index.db.execute("SELECT used FROM snapshots WHERE id = ?", [info.id])
        assert 1.0 < used.fetchone()[0] <= later


def test_prefill_rates_reach_the_cost_model_from_the_stats_thread(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s") as store:
        stats = StatsWriter(store, interval=3600)
        try:
            writers = _writes_by_thread(store)
            for _ in range(5):  # the cost model trusts a rate of several samples
                stats.prefilled(ident, 0, 4096, 2.0)
            assert writers == []  # queued, not written on this thread
            stats.flush()
            assert writers and threading.get_ident() not in writers
            assert store.costs.prefill_seconds(ident, 0, 4096) is not None
        finally:
            stats.close()
