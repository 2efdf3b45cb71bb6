"""The cost model keeps learning (issue 39): an estimate of several samples, a
process's first run kept apart, a declined hit measured again now and then.

One restore slowed by load (8 ``yes`` pinned to its core) declined every later
chat's prefix, for good; here the slow runs are made on the test's clock
(``cost_checks.slowed``), never hoped for: no verdict depends on machine speed.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import persist
from persist.engine.costs import EXPLORE_AFTER, EXPLORE_EVERY
from persist.policy.recompute import MIN_SAMPLES
from persist.storage import rates
from tests.engine.cost_checks import SLOW_PREFILL, TINY_PREFILL, learned, primed, slowed
from tests.helpers import tokens_for


def _slow(store: persist.Store, delay: float) -> None:
    """From now on each blob open takes ``delay`` seconds of the store's fake clock."""
    store.blobs.delay = delay  # type: ignore[attr-defined]


def test_one_slow_restore_among_fast_ones_switches_nothing_off(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=80)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 0.001)
        for _ in range(4):
            assert store.lookup(prompt, identity=ident) is not None
        _slow(store, 30.0)  # one restore under load: 60x slower than a prefill
        assert store.lookup(prompt, identity=ident) is not None
        _slow(store, 0.001)
        for _ in range(10):
            assert store.lookup(prompt, identity=ident) is not None
            d = store.costs.last
            assert d is not None and d.restore and d.reason == "faster", d


def test_a_slow_first_restore_in_every_process_declines_nothing(tiny: Any, tmp_path: Path) -> None:
    """tests/cli/test_user_path's chats, on a loaded machine: each ``persist generate``
    is a fresh process whose one restore carries one-time costs; taken as a rate it
    declined the next chat's shared system prompt.  Now first restores are kept
    apart, price only other processes' first restores, and one of them declines
    nothing (MIN_SAMPLES)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=81)
    primed(model, tok, tmp_path / "s", toks, TINY_PREFILL).close()
    reasons = []
    for _ in range(MIN_SAMPLES):  # processes, each restoring once, slowly
        with slowed(persist.Store(tmp_path / "s"), 30.0) as store:
            assert store.lookup([*toks, 1], identity=ident) is not None
            assert store.costs.last is not None
            reasons.append(store.costs.last.reason)
    assert reasons == ["unmeasured", *["learning"] * (MIN_SAMPLES - 1)]
    with persist.Store(tmp_path / "s") as store:
        kept = {r["what"] for r in rates.all_rates(store.index) if r["key"] == "local"}
        assert kept == {"restore-first"}  # reported apart, never a rate
        slowed(store, 0.001)  # a fourth first restore, priced by three slow first ones
        assert store.lookup([*toks, 1], identity=ident) is None
        assert store.costs.last is not None and store.costs.last.reason == "slower"


def test_a_wrong_estimate_corrects_itself(tiny: Any, tmp_path: Path) -> None:
    """Known slow (declined), then fast again: every EXPLORE_EVERY-th declined hit is
    restored anyway and measured, until the estimate says restore."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=82)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 30.0)
        assert learned(store, prompt, ident)[-1] == "slower"
        _slow(store, 0.001)  # the load went away
        reasons = []
        for _ in range(4 * EXPLORE_EVERY):
            store.lookup(prompt, identity=ident)
            assert store.costs.last is not None
            reasons.append(store.costs.last.reason)
            if reasons[-1] == "faster":
                break
        assert reasons[-1] == "faster", reasons
        explored = [i for i, r in enumerate(reasons) if r == "explore"]
        # the first decline was counted while learning: the first explore comes sooner
        assert explored and explored[0] < EXPLORE_EVERY
        assert all(b - a == EXPLORE_EVERY for a, b in itertools.pairwise(explored))
        assert reasons.count("slower") <= len(explored) * (EXPLORE_EVERY - 1)
        assert set(reasons) <= {"slower", "explore", "uncertain", "faster"}


def test_a_bucket_not_measured_for_long_is_measured_again(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=83)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 30.0)
        assert learned(store, prompt, ident)[-1] == "slower"
        assert store.lookup(prompt, identity=ident) is None
        clock = store.costs.wall
        store.costs.wall = lambda: clock() + EXPLORE_AFTER  # ten minutes on
        assert store.lookup(prompt, identity=ident) is not None
        assert store.costs.last is not None and store.costs.last.reason == "explore"
        store.costs.wall = clock
        assert store.lookup(prompt, identity=ident) is None  # measured now: bounded


def test_a_store_wide_max_cost_and_resetting_the_rates(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=84)
    prompt = [*toks, 5, 6, 7]
    with primed(model, tok, tmp_path / "s", toks, SLOW_PREFILL) as store:
        slowed(store, 0.001)
        for _ in range(3):
            assert store.lookup(prompt, identity=ident) is not None
        store.costs.max_cost = 0.0  # persist generate --max-cost 0
        assert store.lookup(prompt, identity=ident) is None
        assert store.costs.last is not None and store.costs.last.reason == "max_cost"
        assert store.lookup(prompt, identity=ident, max_cost=60.0) is not None  # a call's own
        store.costs.max_cost = None
        here = rates.machine_name(ident.backend)
        assert rates.reset(store.index, "elsewhere") == 0
        assert rates.reset(store.index, here) > 0 and rates.all_rates(store.index) == []
        assert store.lookup(prompt, identity=ident) is not None
        assert store.costs.last is not None and store.costs.last.reason == "unmeasured"
