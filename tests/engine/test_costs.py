"""Restore or recompute: a hit is taken only when restoring it is predicted to beat a
prefill of its tokens, from rates measured on real restores and prefills here.

The slow and fast cases are made on purpose, not hoped for, and never measured
on the wall clock (a busy machine made round 2's versions fail): the cost
model's clock is a fake one that a blob tier advances in every open (a slow
disk or a far tier, by as much as the test says), and prefill rates are
injected where they are recorded (``Store.record_prefill``).  Real stores,
real files and real forwards; only the seconds are the test's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
from bench.common import evict
from persist.apps.generate import generate
from persist.policy import recompute
from persist.storage import blobs as blobs_module
from persist.storage import rates
from tests.engine.cost_checks import (
    SLOW_PREFILL,
    TINY_PREFILL,
    learned,
    prefill_rate,
    primed,
    slowed,
    taught,
)
from tests.helpers import (
    ON_CUDA,
    another_backend,
    assert_same_state,
    continue_run,
    live_state,
    persist_cli,
    prefill,
    raw,
    tokens_for,
)

TO_DECLINE = ["unmeasured", "unmeasured", "learning", "learning", "slower"]


def test_a_slow_tier_is_declined_and_the_answer_is_a_plain_prefill(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=70)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks) as store:
        slowed(store, 0.3)
        assert learned(store, prompt, ident) == TO_DECLINE  # now known to be slow
        d = store.costs.last
        assert d is not None and not d.restore and d.reason == "slower" and d.samples == 3
        assert d.restore_s is not None and d.prefill_s is not None and d.restore_s > d.prefill_s
        assert d.tokens == 600 and d.tier == "local"
        # what the caller does with a declined hit: a plain prefill, bit for bit the same
        cache, logits = prefill(model, prompt)
        fresh, fresh_logits = prefill(model, prompt)
        assert raw(logits) == raw(fresh_logits)
        assert raw(continue_run(model, cache, [9])[0][0]) == raw(
            continue_run(model, fresh, [9])[0][0]
        )
        stats = store.stats()
        assert stats.counters["cost_recomputed"] == 1 and stats.counters["cost_restored"] == 4
        newest = stats.decisions[0]
        assert newest["restore"] is False and newest["restore_s"] > newest["prefill_s"]
        assert {r["what"] for r in stats.rates} == {
            "restore", "restore-first", "prefill", "prefill-first"
        }  # fmt: skip
        # a caller who accepts a slower restore says so in seconds
        assert store.lookup(prompt, identity=ident, max_cost=math.inf) is not None
        assert store.costs.last is not None and store.costs.last.reason == "max_cost"
        assert store.lookup(prompt, identity=ident, max_cost=0.0) is None
        for bad in (-1.0, math.nan):
            with pytest.raises(persist.InvalidArgumentError, match="max_cost"):
                store.lookup(prompt, identity=ident, max_cost=bad)


def test_a_fast_tier_is_taken_and_restores_exactly(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=71)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 0.001)  # a fast disk: a few milliseconds per restore
        for _ in range(3):  # measured, then decided from the measurement
            hit = store.lookup(prompt, identity=ident)
            assert hit is not None and len(hit.tokens) == 600
        d = store.costs.last
        assert d is not None and d.restore and d.reason == "faster"
        assert d.restore_s is not None and d.prefill_s is not None and d.restore_s < d.prefill_s
        assert_same_state(live_state(hit.cache), live_state(prefill(model, toks)[0]))
        _, want = prefill(model, prompt)
        got = model(mx.array([prompt[600:]]), cache=hit.cache)[0, -1]
        assert ON_CUDA or raw(got) == raw(want)  # CUDA: the state (helpers.ON_CUDA says why)


def test_rates_belong_to_their_machine_and_model(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=72)
    with primed(model, tok, tmp_path / "s", toks) as store:
        slowed(store, 0.3)
        store.lookup([*toks, 1], identity=ident)  # measured slow, here
        machines = {r["machine"] for r in rates.all_rates(store.index)}
        assert machines == {rates.machine_name(ident.backend)}
        elsewhere = dataclasses.replace(ident, backend=another_backend(ident.backend))
        assert store.lookup([*toks, 1], identity=elsewhere) is not None
        assert store.costs.last is not None and store.costs.last.reason == "unmeasured"
        other = persist.ModelIdentity.of(*tiny("llama_hd64")[:2])  # another model, same machine
        assert store.costs.prefill_seconds(other, 0, 600) is None
        assert store.costs.prefill_seconds(ident, 0, 600) is not None


def test_generate_reports_the_decision(tiny: Any, tmp_path: Path) -> None:
    """``persist generate --json`` carries it: the declined hit and the plain prefill."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    text = "the quick brown fox jumps over the lazy dog " * 30
    with persist.Store(tmp_path / "plain") as plain:
        want = generate(model, tok, ident, plain, session="a", prompt=text, max_tokens=6)
    with prefill_rate(persist.Store(tmp_path / "s"), TINY_PREFILL) as store:
        generate(model, tok, ident, store, session="a", prompt=text, max_tokens=6)
        taught(store, ident)
        slowed(store, 0.3)
        reasons = []
        for session in "bcdefgh":  # measured until known to be slow
            got = generate(model, tok, ident, store, session=session, prompt=text, max_tokens=6)
            assert got.decision is not None
            reasons.append(got.decision["reason"])
            if not got.decision["restore"]:
                break
    assert reasons == TO_DECLINE and got.decision["restore"] is False
    assert got.source == "none" and got.reused_tokens == 0
    assert got.text == want.text and got.to_dict()["decision"]["reason"] == "slower"


def test_persist_stats_shows_rates_and_decisions(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=73)
    with primed(model, tok, tmp_path / "s", toks) as store:
        slowed(store, 0.3)
        assert learned(store, [*toks, 1], ident) == TO_DECLINE
    out = persist_cli(tmp_path, "stats", "--store", str(tmp_path / "s")).stdout
    assert "first restore from local in a process" in out and "(learning, 1 sample)" in out
    assert "(slower, 3 samples)" in out and "restore from local (128.0 KiB+)" in out
    assert "decision recompute: 600 tokens from local" in out
    assert "decision restore: 600 tokens from local" in out and "(unmeasured)" in out
    assert "prefill at" in out and "tokens/s" in out and "restore from local" in out
    got = json.loads(
        persist_cli(tmp_path, "stats", "--store", str(tmp_path / "s"), "--json").stdout
    )
    assert got["decisions"][0]["restore"] is False and got["counters"]["cost_recomputed"] == 1


def _evicted(store: persist.Store, files: list[str]) -> bool:
    """Drop ``files`` from the page cache; False if it keeps them (DONTNEED ignored).
    Again while a readahead still in flight brings a page back (a bounded retry)."""
    for _ in range(20):
        for f in files:
            evict(store.blobs.path(f))
        if not any(store.blobs.cached(f) for f in files):
            return True
        time.sleep(0.05)
    return False


def test_a_hit_in_the_page_cache_and_one_on_the_disk_have_rates_of_their_own(
    tiny: Any, tmp_path: Path
) -> None:
    """Warm, the files restore fast (taken); evicted, the disk's rate says a prefill
    wins (declined).  One rate for both predicted neither (H200: 0.13 s vs 0.64 s/GiB)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=72)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        files = [store.blobs.path(f) for f in store.blobs.files()]
        for p in files:
            p.read_bytes()
        if {store.blobs.cached(f) for f in store.blobs.files()} != {1.0}:
            pytest.skip("this kernel or file system cannot say what is in the page cache")
        here = rates.machine_name(ident.backend)
        for bucket in range(40 * recompute.MIN_SAMPLES):  # confident in every bucket
            bucket //= recompute.MIN_SAMPLES  # 600 tokens prefill in 0.6 s; 1 GB/s, 1 kB/s
            rates.record(store.index, here, "restore", key="local", bucket=bucket, rate=1e9)
            rates.record(store.index, here, "restore", key="local-disk", bucket=bucket, rate=1e3)
        warm = store.lookup(prompt, identity=ident)
        assert warm is not None and store.costs.last is not None
        assert store.costs.last.tier == "local" and store.costs.last.restore
        if not _evicted(store, list(store.blobs.files())):
            pytest.skip("the page cache kept the files (DONTNEED ignored here)")
        assert store.lookup(prompt, identity=ident) is None
        d = store.costs.last
        assert d is not None and d.tier == "local-disk" and not d.restore
        assert d.restore_s is not None and d.prefill_s is not None and d.restore_s > d.prefill_s


def test_a_store_that_cannot_tell_keeps_one_local_rate(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=73)
    with primed(model, tok, tmp_path / "s", toks) as store:
        monkeypatch.setattr(blobs_module, "_libc_mincore", lambda: None)
        assert {store.blobs.cached(f) for f in store.blobs.files()} == {None}
        assert store.lookup([*toks, 1, 2], identity=ident) is not None
        assert store.costs.last is not None and store.costs.last.tier == "local"


def test_looking_at_the_page_cache_loads_nothing(tiny: Any, tmp_path: Path) -> None:
    """Attack 27 (round 4): the RWF_NOWAIT probe started readahead of what it probed,
    so sixteen lookups of a hit on the disk made it look cached; mincore loads nothing."""
    model, tok, _ = tiny("llama")
    toks = tokens_for(300, seed=74)
    with primed(model, tok, tmp_path / "s", toks) as store:
        files = list(store.blobs.files())
        if not _evicted(store, files):
            pytest.skip("the page cache kept the files (DONTNEED ignored here)")
        for _ in range(30):
            assert not any(store.blobs.cached(f) for f in files)


def test_the_sample_reaches_the_last_blocks_of_a_hit(tiny: Any, tmp_path: Path) -> None:
    """Attack 27 (round 4): the sample skipped the end of the file list; a hit whose
    last blocks are on the disk is priced at the disk's rate."""
    from persist.engine.costs import LOCAL, LOCAL_DISK, local_hit

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=75)
    with persist.Store(tmp_path / "s", block_tokens=16) as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="doc")
        row = store.index.by_name("default", "doc")
        assert row is not None and row.n_blocks >= 30
        blocks = [b.blob for b in store.index.blocks(row.id) if b.blob is not None]
        for f in [row.tail, *blocks]:
            store.blobs.path(f).read_bytes()
        if store.blobs.cached(row.tail) != 1.0:
            pytest.skip("this file system cannot say what is in the page cache")
        assert local_hit(store.index, store.blobs, row, None)[0] == LOCAL
        _evicted(store, blocks[-7:])
        assert local_hit(store.index, store.blobs, row, None)[0] == LOCAL_DISK


def test_a_hit_is_priced_against_the_prefill_past_what_memory_holds(
    tiny: Any, tmp_path: Path
) -> None:
    """A server's memory holding most of a stored prefix: declining the stored hit costs
    a prefill of the tokens past memory's, not of them all (the H200 run: 7,241 tokens
    restored in 0.4 s where memory held 7,073 and plain mlx_lm.server took 0.18 s)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=75)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 0.02)  # a restore: 0.02 s per blob; 600 tokens prefill in 0.6 s
        for _ in range(4):  # measured: faster than prefilling all 600
            assert store.lookup(prompt, identity=ident) is not None
        d = store.costs.last
        assert d is not None and d.restore and d.reason == "faster" and d.held == 0
        # memory holds 590 of them: a prefill of 10 tokens (0.01 s) beats the restore
        assert store.lookup(prompt, identity=ident, longer_than=590) is None
        d = store.costs.last
        assert d is not None and not d.restore and d.reason == "slower" and d.held == 590
        assert d.prefill_s == pytest.approx(10 / SLOW_PREFILL)
        assert d.restore_s is not None and 10 / SLOW_PREFILL < d.restore_s < 600 / SLOW_PREFILL
        assert store.stats().decisions[0]["held"] == 590
        # memory holding fewer: the restore wins again
        assert store.lookup(prompt, identity=ident, longer_than=100) is not None
        assert store.costs.last is not None and store.costs.last.held == 100


def test_a_tier_not_measured_yet_is_bounded_by_one_that_was(tiny: Any, tmp_path: Path) -> None:
    """A restart: the store's own files were never restored on this machine, its host
    tier was, confidently.  Where memory holds most of the hit, a restore that loses
    even at the host tier's optimistic rate is declined (``bound``) instead of taken to
    learn (the H100 run: 7,241 tokens restored in 0.39-0.47 s after a restart, memory
    holding 7,073, while plain mlx_lm.server took 0.20-0.27 s)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=76)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 0.0)
        got = store.costs.predict(ident, [("local", 1)], 600, None)
        assert got.restore_s is None  # local: never measured here
        d0 = store.lookup(prompt, identity=ident, max_cost=math.inf)
        assert d0 is not None and store.costs.last is not None
        nbytes = store.costs.last.nbytes
        rates.reset(store.index)  # what that restore taught: this machine is fresh again
        here = rates.machine_name(ident.backend)
        for _ in range(3):  # the host tier: this hit's bytes in 0.05 s at best
            rates.record(store.index, here, "restore", key="host",
                         bucket=recompute.rate_bucket(nbytes), rate=nbytes / 0.05)  # fmt: skip
        taught(store, ident, 600)  # at SLOW_PREFILL (primed injects the rate)
        # memory holds 590: the 10 left prefill in 0.01 s, the restore needs 0.05 s at best
        assert store.lookup(prompt, identity=ident, longer_than=590) is None
        d = store.costs.last
        assert d is not None and (d.restore, d.reason) == (False, "bound"), d
        assert d.floor_s == pytest.approx(0.05) and d.restore_s is None
        said = persist_cli(tmp_path, "stats", "--store", str(tmp_path / "s")).stdout
        assert "restore unmeasured vs prefill 0.010 s (bound: 0.050 s at the fastest" in said
        # memory holds nothing: 600 tokens prefill in 0.6 s, so the hit is taken and measured
        assert store.lookup(prompt, identity=ident) is not None
        assert store.costs.last is not None and store.costs.last.reason == "unmeasured"


def test_the_tier_names_the_floor_orders_are_the_engines(tiny: Any) -> None:
    """policy.recompute orders tiers by name (it imports no engine): the same names."""
    from persist.engine.costs import LOCAL, LOCAL_DISK
    from persist.engine.host.tier import HOST

    assert set(recompute.FASTER_THAN) == {HOST, LOCAL, LOCAL_DISK}
    assert recompute.FASTER_THAN[LOCAL_DISK] == (HOST, LOCAL)


def _planted_prefill(store: persist.Store, ident: Any, rate: float) -> None:
    """Every prefill bucket (and a process's first) measured at ``rate`` tokens/s."""
    here = rates.machine_name(ident.backend)
    for what in ("prefill", "prefill-first"):
        for b in range(1, 15):
            for _ in range(recompute.MIN_SAMPLES):
                rates.record(store.index, here, what, key=ident.digest, bucket=b, rate=rate)


def test_a_slower_tier_never_bounds_the_host_tier(tiny: Any, tmp_path: Path) -> None:
    """Attack 39j: the host tier unmeasured, a slow local rate bounded it ("bound") and its
    RAM copy was declined; every tier is at most as fast as the host tier."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    small = tokens_for(600, seed=77)
    with persist.Store(tmp_path / "s", host_cache=1 << 30) as store:
        store.save(prefill(model, small)[0], small, identity=ident, session="small")
        here = rates.machine_name(ident.backend)
        for what in ("restore", "restore-first"):
            for b in range(1, 40):  # the store's files: 1 KB/s, confidently
                for _ in range(5):
                    rates.record(store.index, here, what, key="local", bucket=b, rate=1e3)
        _planted_prefill(store, ident, 2000.0)
        hit = store.lookup([*small, 1, 2], identity=ident)
        assert hit is not None and hit.source == "host", store.costs.last
        assert store.costs.last is not None and store.costs.last.tier == "host"


def test_a_stored_hit_past_a_host_copy_is_priced_against_the_copy_and_its_prefill(
    tiny: Any, tmp_path: Path
) -> None:
    """Attack 39j: with the host tier's copy of 3,000 tokens taken, a stored 6,000-token
    hit was priced against a prefill of all 6,000 (memory held none), not against the
    copy and a prefill of the 3,000 past it: a slower restore won on paper.  And the
    decision the lookup acted on is ``costs.last``."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    big = tokens_for(1200, seed=78)
    root = tmp_path / "s"
    with persist.Store(root) as store:  # the long one on disk only
        store.save(prefill(model, big)[0], big, identity=ident, session="big")
    with persist.Store(root, host_cache=1 << 30) as store:
        half = big[:600]
        store.save(prefill(model, half)[0], half, identity=ident, session="half")
        assert store.lookup([*big, 1], identity=ident, max_cost=math.inf) is not None
        assert store.costs.last is not None and store.costs.last.tokens == 1200
        nbytes = store.costs.last.nbytes
        rates.reset(store.index)
        _planted_prefill(store, ident, 2000.0)  # 1,200 tokens in 0.6 s, the last 600 in 0.3
        here = rates.machine_name(ident.backend)
        for _ in range(5):  # the stored 1,200 tokens restore in 0.45 s
            rates.record(store.index, here, "restore", key="local",
                         bucket=recompute.rate_bucket(nbytes), rate=nbytes / 0.45)  # fmt: skip
        hit = store.lookup([*big, 1], identity=ident)
        assert hit is not None and (hit.source, len(hit.tokens)) == ("host", 600)
        d = store.costs.last
        assert d is not None and (d.tier, d.restore) == ("host", True), d


def test_a_floor_bounds_only_while_it_is_fresh(tiny: Any, tmp_path: Path) -> None:
    """Attack 39k: three slow host-tier samples declined a stored hit ("bound") in every
    fresh process that had no host tier to time again, for good.  A floor older than
    EXPLORE_AFTER bounds nothing: the hit is restored, and its own rate measured."""
    from persist.engine.costs import EXPLORE_AFTER

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=79)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 0.0)  # the model's wall clock is the test's: now is 0
        here = rates.machine_name(ident.backend)
        for bucket in range(40 * recompute.MIN_SAMPLES):  # the host tier: 1 kB/s, now
            rates.record(store.index, here, "restore", key="host",
                         bucket=bucket // recompute.MIN_SAMPLES, rate=1e3, at=0.0)  # fmt: skip
        assert store.lookup(prompt, identity=ident) is None
        assert store.costs.last is not None and store.costs.last.reason == "bound"
        store.costs.wall = lambda: EXPLORE_AFTER + 1.0  # ten minutes on, none timed again
        assert store.lookup(prompt, identity=ident) is not None
        assert store.costs.last is not None and store.costs.last.reason == "unmeasured"
