"""``persist.Store(root, host_cache=N)``: saves kept in RAM, served to lookups first,
bit-exact against the durable store, never an alias, never another model's."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
from persist.codecs.snapshot import capture
from tests.engine.host_checks import GIB, durable, ident, scribble_all
from tests.helpers import (
    NEXT,
    assert_same_state,
    continue_run,
    kv_quantized,
    live_state,
    prefill,
    raw,
    tokens_for,
)
from tests.store_helpers import clean


def ticking(store: persist.Store) -> None:
    """Copies take 1 ms by the tier's clock: rates without wall-clock verdicts."""
    assert store.host is not None
    ticks = itertools.count()
    store.host.clock = lambda: next(ticks) / 1000


def rooms(cache: list[Any]) -> list[Any]:
    """Each attention layer's buffer shape: its live positions and the room past them."""
    return [getattr(c, "keys", None) is not None and tuple(c.keys.shape) for c in cache]


@pytest.mark.parametrize("variant", ["llama", "gemma3", "qwen3_next"])
def test_host_hit_equals_the_durable_one_and_continues_as_a_prefill(
    tiny: Any, tmp_path: Path, variant: str
) -> None:
    model, identity = ident(tiny, variant)
    toks = tokens_for(300, seed=3)
    cache, _ = prefill(model, toks)
    root = tmp_path / "store"
    with persist.Store(root, host_cache=GIB) as store:
        store.save(cache, toks, identity=identity, session="s")
        for prompt in ([*toks, *NEXT], [*toks[:200], 7, 8, 9]):
            hit = store.lookup(prompt, identity=identity)
            want = durable(root, prompt, identity)
            if want is None:  # an untrimmable cache serves only at its own length
                assert hit is None and variant != "llama" and len(prompt) < 300
                continue
            assert hit is not None and hit.source == "host"
            assert hit.tokens == want.tokens and hit.entry.session == "s"
            assert_same_state(live_state(hit.cache), live_state(want.cache))
            assert rooms(hit.cache) == rooms(want.cache)  # the same room to grow into
        hit = store.lookup([*toks, *NEXT], identity=identity)
        assert hit is not None and hit.tokens == toks
        fresh, _ = prefill(model, toks)
        got_logits, got = continue_run(model, hit.cache, NEXT)
        want_logits, want_greedy = continue_run(model, fresh, NEXT)
        assert got == want_greedy
        assert all(raw(a) == raw(b) for a, b in zip(got_logits, want_logits, strict=True))
        assert_same_state(live_state(hit.cache), live_state(fresh))
        clean(store)


def test_a_quantized_floor_holds_in_ram_too(tiny: Any, tmp_path: Path) -> None:
    cfg = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 100}
    model, identity = ident(tiny, "llama_hd64", **cfg)
    toks = tokens_for(300, seed=5)
    cache = kv_quantized(model, toks, 100)
    root = tmp_path / "store"
    with persist.Store(root, host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        below = [*toks[:150], 1, 2]  # under the conversion point: no fresh run has that state
        assert store.lookup(below, identity=identity) is None
        assert durable(root, below, identity) is None
        hit = store.lookup([*toks, 5], identity=identity)
        want = durable(root, [*toks, 5], identity)
        assert hit is not None and want is not None and hit.source == "host"
        assert_same_state(live_state(hit.cache), live_state(want.cache))


@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_the_kept_copy_is_never_an_alias(tiny: Any, tmp_path: Path, variant: str) -> None:
    model, identity = ident(tiny, variant)
    toks = tokens_for(256, seed=4)  # a full 256-step buffer: its live slice is all of it
    cache, _ = prefill(model, toks)
    saved = live_state(cache)
    with persist.Store(tmp_path / "store", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity, session="s")
        # the caller goes on: its buffers written in place, raw and through MLX
        scribble_all(cache)
        continue_run(model, cache, NEXT, n_greedy=2)
        prompt = [*toks, 1, 2]
        first = store.lookup(prompt, identity=identity)
        assert first is not None and first.source == "host"
        assert_same_state(live_state(first.cache), saved)
        # nor does a hit share memory with the entry: write it, ask again
        scribble_all(first.cache)
        second = store.lookup(prompt, identity=identity)
        assert second is not None and second.source == "host"
        assert_same_state(live_state(second.cache), saved)


def test_a_snapshot_and_a_checkpoint_are_kept(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    toks = tokens_for(300, seed=6)
    part, _ = prefill(model, toks[:100])
    with persist.Store(tmp_path / "store", host_cache=GIB) as store:
        store.checkpoint(part, toks[:100], identity=identity, session="doc")
        whole, _ = prefill(model, toks[100:], cache=part)
        store.save(capture(whole, toks), toks, identity=identity, session="doc")
        assert store.host is not None and len(store.host) == 2  # a checkpoint is not covered
        hit = store.lookup([*toks[:100], 9], identity=identity)
        assert hit is not None and hit.source == "host" and hit.entry.role == "checkpoint"
        hit = store.lookup([*toks, 9], identity=identity)
        assert hit is not None and hit.source == "host" and hit.tokens == toks
        # the next turn stands in for this one (policy.covers), not for the checkpoint
        turn, _ = prefill(model, NEXT, cache=whole)
        store.save(turn, [*toks, *NEXT], identity=identity, session="doc")
        assert len(store.host) == 2
        hit = store.lookup([*toks, 9], identity=identity)
        assert hit is not None and hit.source == "host" and hit.entry.tokens == 304


def test_budget_evicts_the_least_recently_used(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    prompts = [tokens_for(100, seed=s) for s in (10, 11, 12)]
    caches = [prefill(model, p)[0] for p in prompts]
    with persist.Store(tmp_path / "probe", host_cache=GIB) as probe:
        probe.save(caches[0], prompts[0], identity=identity)
        size = probe.stats().host_cache["bytes"]  # type: ignore[index]
    with persist.Store(tmp_path / "store", host_cache=2 * size) as store:
        store.save(caches[0], prompts[0], identity=identity)
        store.save(caches[1], prompts[1], identity=identity)
        hit = store.lookup([*prompts[0], 1], identity=identity)  # 0 is now the most recent
        assert hit is not None and hit.source == "host"
        store.save(caches[2], prompts[2], identity=identity)  # over budget: 1 goes
        got = store.stats().host_cache
        assert got is not None
        assert got["entries"] == 2 and got["evicted"] == 1 and got["bytes"] == 2 * size
        assert got["budget_bytes"] == 2 * size and got["hits"] == 1
        gone = store.lookup([*prompts[1], 1], identity=identity)
        assert gone is not None and gone.source == "local"  # the store still has it
        for p in (prompts[0], prompts[2]):
            hit = store.lookup([*p, 1], identity=identity)
            assert hit is not None and hit.source == "host"
        clean(store)


def test_other_models_namespaces_and_backends_never_get_it(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    _, other = ident(tiny, "llama_hd64")
    toks = tokens_for(200, seed=7)
    cache, _ = prefill(model, toks)
    prompt = [*toks, 1]
    with persist.Store(tmp_path / "store", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity, namespace="a")
        assert store.lookup(prompt, identity=other, namespace="a") is None
        assert store.lookup(prompt, identity=identity, namespace="b") is None
        assert store.host is not None and store.host.stats()["hits"] == 0
    elsewhere = dataclasses.replace(identity, backend="cuda:Some GPU")
    assert elsewhere.digest == identity.digest  # the backend is not the model
    with persist.Store(tmp_path / "strict", host_cache=GIB, strict_backend=True) as strict:
        strict.save(cache, toks, identity=identity)
        assert strict.lookup(prompt, identity=elsewhere) is None


def test_unverified_saves_are_never_kept(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    toks = tokens_for(200, seed=8)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "store", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity, session="u", unverified_tokens=True)
        more, _ = prefill(model, NEXT, cache=cache)
        # continued from unverified tokens: unverified too (engine.unverified)
        store.save(more, [*toks, *NEXT], identity=identity, session="u")
        assert store.host is not None and len(store.host) == 0
        assert store.lookup([*toks, *NEXT, 1], identity=identity) is None
        assert store.restore("u", identity=identity).source == "local"  # by name: as ever


def test_rates_counters_stats_and_close(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    toks = tokens_for(200, seed=9)
    cache, _ = prefill(model, toks)
    store = persist.Store(tmp_path / "store", host_cache=GIB)
    ticking(store)
    store.save(cache, toks, identity=identity, session="s")
    hit = store.lookup([*toks, 1], identity=identity)
    assert hit is not None and hit.source == "host"
    assert store.costs.last is not None and store.costs.last.tier == "host"
    stats = store.stats()
    assert stats.counters["host_hits"] == 1 and stats.counters["restored_tokens"] == 200
    assert "misses" not in stats.counters  # the store was not asked in vain
    # the process's first copy carries its one-time costs: kept apart, never a rate
    assert any(r["what"] == "restore-first" and r["key"] == "host" for r in stats.rates)
    assert not any(r["what"] == "restore" for r in stats.rates)
    host = stats.host_cache
    assert host is not None and host["entries"] == 1 and host["hits"] == 1
    assert 0 < host["bytes"] <= host["budget_bytes"] == GIB
    # removed from the store, the RAM copy is still an exact state of those tokens
    store.delete("s")
    again = store.lookup([*toks, 1], identity=identity)
    assert again is not None and again.source == "host"
    tier = store.host
    assert tier is not None
    store.close()
    assert store.host is None and len(tier) == 0 and tier.nbytes == 0
    with persist.Store(tmp_path / "store") as plain:
        assert plain.host is None and plain.stats().host_cache is None


def test_no_tier_and_bad_sizes(tmp_path: Path) -> None:
    for none in (0, None):
        with persist.Store(tmp_path / "a", host_cache=none) as s:
            assert s.host is None
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(persist.InvalidArgumentError):
            persist.Store(tmp_path / "b", host_cache=bad)  # type: ignore[arg-type]


def test_a_host_hit_is_a_fresh_evaluated_cache(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    toks = tokens_for(100, seed=13)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "store", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        hit = store.lookup([*toks, 1], identity=identity)
        assert hit is not None
        assert all(a is not b for a, b in zip(hit.cache, cache, strict=True))
        assert isinstance(hit.cache[0].keys, mx.array)


def size_of(tiny: Any, tmp_path: Path) -> tuple[Any, Any, list[int], list[Any], int]:
    model, identity = ident(tiny, "llama")
    toks = tokens_for(50, seed=26)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "probe", host_cache=GIB) as probe:
        probe.save(cache, toks, identity=identity)
        size = probe.stats().host_cache["bytes"]  # type: ignore[index]
    return model, identity, toks, cache, size


@pytest.mark.parametrize("delta", [0, -1, 1])
def test_budget_edges(tiny: Any, tmp_path: Path, delta: int) -> None:
    _, identity, toks, cache, size = size_of(tiny, tmp_path)
    with persist.Store(tmp_path / "s", host_cache=size + delta) as store:
        store.save(cache, toks, identity=identity)
        host = store.stats().host_cache
        assert host is not None and host["budget_bytes"] == size + delta
        assert host["bytes"] <= host["budget_bytes"]
        hit = store.lookup([*toks, 1], identity=identity)
        assert hit is not None
        assert hit.source == ("local" if delta < 0 else "host")
        assert host["entries"] == (0 if delta < 0 else 1)


def test_tiny_and_huge_budgets(tiny: Any, tmp_path: Path) -> None:
    _, identity, toks, cache, _ = size_of(tiny, tmp_path)
    for budget in (1, 1 << 62):
        with persist.Store(tmp_path / f"s{budget}", host_cache=budget) as store:
            store.save(cache, toks, identity=identity)
            hit = store.lookup([*toks, 1], identity=identity)
            assert hit is not None and hit.source == ("local" if budget == 1 else "host")
            host = store.stats().host_cache
            assert host is not None and host["bytes"] <= budget


def test_close_then_use_is_typed(tiny: Any, tmp_path: Path) -> None:
    _, identity, toks, cache, _ = size_of(tiny, tmp_path)
    store = persist.Store(tmp_path / "s", host_cache=GIB)
    store.save(cache, toks, identity=identity)
    store.close()
    with pytest.raises(persist.errors.InvalidStateError, match="closed"):
        store.lookup([*toks, 1], identity=identity)
    with pytest.raises(persist.errors.InvalidStateError, match="closed"):
        store.save(cache, toks, identity=identity)


def test_host_misses_are_counted(tiny: Any, tmp_path: Path) -> None:
    _, identity, toks, cache, _ = size_of(tiny, tmp_path)
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        assert store.lookup(tokens_for(40, seed=99), identity=identity) is None
        assert store.stats().counters["misses"] == 1  # the store counted it
        host = store.stats().host_cache
        assert host is not None and host["hits"] == 0
        assert host["misses"] == 1


def test_a_host_copy_declined_for_cost_is_not_read_from_disk(tiny: Any, tmp_path: Path) -> None:
    _, identity, toks, cache, _ = size_of(tiny, tmp_path)
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        for _ in range(2):  # the first copy is a process's one-time cost; the second a rate
            assert store.lookup([*toks, 1], identity=identity) is not None
        declined = store.lookup([*toks, 1], identity=identity, max_cost=0.0)
        assert declined is None, (declined.source, store.costs.last)


def test_threads_save_and_look_up_in_one_store(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "llama")
    prompts = [tokens_for(40 + 7 * i, seed=30 + i) for i in range(6)]
    caches = [prefill(model, p)[0] for p in prompts]
    states = [live_state(c) for c in caches]
    errors: list[BaseException] = []
    got: list[tuple[int, Any]] = []
    lock = threading.Lock()
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:

        def work(i: int) -> None:
            try:
                for _ in range(3):
                    store.save(caches[i], prompts[i], identity=identity)
                    for j in range(len(prompts)):
                        hit = store.lookup([*prompts[j], 1], identity=identity)
                        if hit is not None:
                            with lock:
                                got.append((j, hit))
            except BaseException as e:
                errors.append(e)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        for j, hit in got:
            assert hit.tokens == prompts[j]
            assert_same_state(live_state(hit.cache), states[j])
        host = store.stats().host_cache
        assert host is not None and host["entries"] == len(prompts)
        assert host["hits"] == sum(1 for _, h in got if h.source == "host")
