"""A request that gains nothing costs nothing (issue 39): the same tokens are captured
once per process, and a prompt memory already answers asks no other tier.  Real
tiny models, a real store; the store's lookups are counted, not replaced."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import persist
from persist.engine.host.tier import HostTier
from persist.serve import server as server_module
from persist.serve.kept_keys import KeptKeys
from persist.serve.server import PersistentPromptCache
from tests.helpers import assert_same_state, live_state, prefill, tokens_for


def _asked(store: persist.Store) -> list[int]:
    """The store's lookups from now on, counted (each still runs)."""
    calls: list[int] = []
    real = store.lookup

    def lookup(tokens: Any, **kw: Any) -> Any:
        calls.append(len(tokens))
        return real(tokens, **kw)

    store.lookup = lookup  # type: ignore[method-assign]
    return calls


def test_the_same_tokens_are_captured_once(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks, other = tokens_for(80, seed=90), tokens_for(80, seed=91)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            for _ in range(3):  # a retried request answered the same way
                pc.insert_cache("m", toks, prefill(model, toks)[0])
            pc.insert_cache("m", other, prefill(model, other)[0])
            pc.flush()
            assert pc.counters["captures_skipped"] == 2 and pc.counters["persisted"] == 2
            assert len(store.entries()) == 2
            assert store.stats().counters["serve_captures_skipped"] == 2
        finally:
            pc.close()
        again = PersistentPromptCache(4, store=store, identity=ident, namespace="other")
        try:  # another namespace's copy is its own
            again.insert_cache("m", toks, prefill(model, toks)[0])
            again.flush()
            assert again.counters["persisted"] == 1 and "captures_skipped" not in again.counters
        finally:
            again.close()


def test_a_prompt_memory_answers_asks_no_other_tier(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(80, seed=92)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            pc.insert_cache("m", toks, prefill(model, toks)[0])
            pc.flush()
            asked = _asked(store)
            # all of it in memory: handed out one token short (mlx-lm fails on nothing
            # left to feed: test_exact_hit), still asking no other tier
            cache, rest = pc.fetch_nearest_cache("m", toks)
            assert cache is not None and rest == toks[-1:] and asked == []
            cache, rest = pc.fetch_nearest_cache("m", [*toks, 5])  # all but the last token
            assert cache is not None and rest == [5] and asked == []
            assert pc.counters["memory_hits"] == 2
            cache, rest = pc.fetch_nearest_cache("m", [*toks, 5, 6])  # the store may be longer
            assert cache is not None and rest == [5, 6] and asked == [82]
        finally:
            pc.close()


def test_kept_keys_are_bounded_and_exact() -> None:
    kept = KeptKeys(keep=2)
    a, b, c = (KeptKeys.key("d", "ns", [1, 2, i]) for i in range(3))
    assert KeptKeys.key("d", "ns", [1, 2]) != KeptKeys.key("d", "ns2", [1, 2])
    assert KeptKeys.key("d", "n", [1]) != KeptKeys.key("dn", "", [1])  # no run-together
    kept.add(a)
    kept.add(b)
    assert a in kept  # a is now the most recent
    kept.add(c)
    assert a in kept and c in kept and b not in kept and len(kept) == 2


def test_capture_runs_on_the_writer_thread_and_saves_the_cache(
    tiny: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    # The copy to host bytes never runs on the caller's (mlx-lm's generation)
    # thread: a spy records where capture ran, and the saved cache is the one given.
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(80, seed=93)
    threads: list[str] = []
    real = server_module.capture

    def spy(layers: Any, tokens: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(layers, tokens)

    monkeypatch.setattr(server_module, "capture", spy)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            live = prefill(model, toks)[0]
            pc.insert_cache("m", toks, live)
            pc.flush()
        finally:
            pc.close()
        assert threads == ["persist-writer"]
        hit = store.lookup([*toks, 7], identity=ident)
        assert hit is not None and list(hit.tokens) == toks
        assert_same_state(live_state(hit.cache), live_state(live))


def test_an_evicted_cache_is_kept_off_the_generation_thread(
    tiny: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    # mlx-lm evicts inside its insert, which its server makes mid-prompt: the copy
    # into the host tier (on a GPU, pinned pages and a device-to-host read) runs on
    # persist's keeper thread, and the next lookup finds the kept cache there.
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    first, second = tokens_for(60, seed=94), tokens_for(60, seed=95)
    threads: list[str] = []
    host = HostTier(1 << 30)
    real = host.keep

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(host, "keep", spy)
    with persist.Store(tmp_path / "s", max_bytes=1 << 30) as store:
        pc = PersistentPromptCache(1, store=store, identity=ident, host=host)
        try:
            pc.insert_cache("m", first, prefill(model, first)[0])
            pc.insert_cache("m", second, prefill(model, second)[0])  # evicts the first
            cache, rest = pc.fetch_nearest_cache("m", [*first, 5])
        finally:
            pc.close()
        assert threads == ["persist-keeper"]
        assert cache is not None and rest == [5]
        assert pc.counters["host_hits"] == 1


def test_an_evicted_cache_still_lazy_is_kept(tiny: Any, tmp_path: Path) -> None:
    # An outside attack: a batched request's cache can reach mlx-lm's eviction
    # unevaluated (an insert of tokens already stored skips the hand-off), and the
    # keeper thread could not evaluate it there ("no Stream(cpu, 1) in current
    # thread"): the evicted cache was lost to the host tier.
    from mlx_lm.models.cache import KVCache

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(60, seed=96)
    live = prefill(model, toks)[0]
    lazy = []
    for c in live:
        k = KVCache()
        k.update_and_fetch(c.keys[..., : c.offset, :] * 1, c.values[..., : c.offset, :] * 1)
        lazy.append(k)  # not evaluated: computed where it was made
    host = HostTier(1 << 30)
    with persist.Store(tmp_path / "s", max_bytes=1 << 30) as store:
        pc = PersistentPromptCache(1, store=store, identity=ident, host=host)
        try:
            pc._evicted("m", toks, lazy)
            pc.flush()
        finally:
            pc.close()
        assert host.stats()["kept"] == 1


def _judging(store: persist.Store, ident: Any, gate: Any) -> tuple[Any, Any]:
    """A tenant-scoped prompt cache of one entry that counts misses by reason."""
    from persist.serve import tenant_serving as ts
    from persist.serve.explaining import miss_counter
    from persist.serve.metrics import ServeMetrics
    from persist.serve.tenants import Tenants

    metrics = ServeMetrics(store, "default")
    metrics.misses = miss_counter(metrics.registry)
    pc = ts.scoped_cache(PersistentPromptCache)(
        1, tenants=Tenants("default"), store=store, identity=ident, metrics=metrics,
        queue_size=8, gate=gate,
    )  # fmt: skip
    return pc, metrics


def test_a_miss_is_judged_on_the_store_its_lookup_saw(tiny: Any, tmp_path: Path) -> None:
    # attack 39h: P's save still queued, P evicted from memory by Q, then P's next turn:
    # the lookup reuses nothing; judged after P's save committed it was counted as a hit
    from persist.serve import tenant_serving as ts
    from persist.serve.quiet import RequestGate

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r_toks, p_toks, q_toks = (tokens_for(80, seed=s) for s in (93, 94, 95))
    gate = RequestGate(hold=600)
    with persist.Store(tmp_path / "s") as store:
        pc, metrics = _judging(store, ident, gate)
        ts._here.asking, ts._here.single = ts.Asking("default"), True
        leave = gate.enter()
        try:
            pc.insert_cache("m", r_toks, prefill(model, r_toks)[0])
            assert gate.wait_for_waiters(1, 60)  # R's save in writing: P's waits in the queue
            pc.insert_cache("m", p_toks, prefill(model, p_toks)[0])
            pc.insert_cache("m", q_toks, prefill(model, q_toks)[0])  # evicts P from memory
            cache, rest = pc.fetch_nearest_cache("m", [*p_toks, 7, 8])
            assert cache is None and len(rest) == 82  # nothing reused
            leave()
            pc.flush()
            assert store.lookup([*p_toks, 7, 8], identity=ident) is not None  # P is stored now
            assert metrics.misses.labels("empty")._value.get() == 1  # judged as looked up
        finally:
            leave()
            ts._here.asking, ts._here.single = None, False
            pc.close()


def test_a_miss_beside_a_save_is_judged_off_the_generation_thread(
    tiny: Any, tmp_path: Path
) -> None:
    # issue 39: a miss while the write-behind was busy judged on the generation thread
    # (~7 ms a request on an H100).  Judged on the writer, it must still see the store
    # as its lookup did: P's save, in writing at the lookup, commits after the verdict.
    from persist.serve import tenant_serving as ts
    from persist.serve.quiet import RequestGate

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    p_toks, q_toks = tokens_for(80, seed=97), tokens_for(80, seed=98)
    gate = RequestGate(hold=600)
    with persist.Store(tmp_path / "s") as store:
        pc, metrics = _judging(store, ident, gate)
        ts._here.asking, ts._here.single = ts.Asking("default"), True
        leave = gate.enter()  # a request prompts: P's save waits in writing
        try:
            pc.insert_cache("m", p_toks, prefill(model, p_toks)[0])
            assert gate.wait_for_waiters(1, 60)
            pc.insert_cache("m", q_toks, prefill(model, q_toks)[0])  # evicts P from memory
            cache, rest = pc.fetch_nearest_cache("m", [*p_toks, 7, 8])
            assert cache is None and len(rest) == 82
            on_thread = metrics.registry.get_sample_value(
                "persist_generation_thread_seconds_count", {"step": "explain"}
            )
            assert not on_thread  # no index read on the generation thread
            leave()
            pc.flush()
            assert store.lookup([*p_toks, 7, 8], identity=ident) is not None  # P is stored now
            assert metrics.misses.labels("empty")._value.get() == 1  # judged as looked up
        finally:
            leave()
            ts._here.asking, ts._here.single = None, False
            pc.close()


def test_a_lookup_that_skipped_a_damaged_snapshot_is_not_a_hit(tiny: Any, tmp_path: Path) -> None:
    # attack r14, A1: P's blobs damaged on disk (its index row intact): the lookup
    # skipped it and reused nothing, and the verdict, read from the index alone, was
    # "hit" (told to a client that asked, and not counted in persist_misses_total)
    from persist.serve import tenant_serving as ts
    from persist.serve.explaining import ExplainSlot

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    p_toks, q_toks = tokens_for(80, seed=103), tokens_for(80, seed=104)
    with persist.Store(tmp_path / "s") as store:
        store.save(prefill(model, p_toks)[0], p_toks, identity=ident)
        for f in (tmp_path / "s" / "blobs").rglob("*"):
            if f.is_file():  # bytes flipped in the middle: the header still parses
                b = bytearray(f.read_bytes())
                for k in range(len(b) // 2, len(b) // 2 + 64):
                    b[k] ^= 0xFF
                f.write_bytes(bytes(b))
        pc, metrics = _judging(store, ident, None)
        asked = ExplainSlot()
        ts._here.asking, ts._here.single = ts.Asking("default", explain=asked), True
        try:
            cache, _rest = pc.fetch_nearest_cache("m", [*p_toks, 7, 8])
            assert cache is None
            assert asked.verdict is not None and asked.verdict.reason == "damaged"
            ts._here.asking = ts.Asking("default")  # one that did not ask: counted too
            pc.insert_cache("m", q_toks, prefill(model, q_toks)[0])
            cache, _rest = pc.fetch_nearest_cache("m", [*p_toks, 9])
            assert cache is None
            pc.flush()
            assert metrics.misses.labels("damaged")._value.get() == 2
        finally:
            ts._here.asking, ts._here.single = None, False
            pc.close()
