"""The restore-or-recompute rule (``persist.policy.recompute``) and partial reads
(``policy.partial_blocks``): pure functions, Hypothesis."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist import policy
from persist.policy import recompute

rates = st.dictionaries(st.integers(0, 40), st.floats(1e-3, 1e12), max_size=8)


def test_buckets_are_powers_of_two() -> None:
    assert [recompute.rate_bucket(n) for n in (0, 1, 2, 3, 4, 255, 256, 1 << 20)] == [
        0, 1, 2, 2, 3, 8, 9, 21,
    ]  # fmt: skip


@given(rates, st.integers(0, 1 << 18), st.integers(0, 1 << 18), st.integers(0, 1 << 18))
def test_prefill_time_adds_up_over_a_split(r: dict[int, float], a: int, b: int, c: int) -> None:
    lo, mid, hi = sorted((a, b, c))
    whole = recompute.prefill_seconds(r, lo, hi)
    if not r:
        assert whole is None
        return
    parts = recompute.prefill_seconds(r, lo, mid), recompute.prefill_seconds(r, mid, hi)
    assert whole is not None and all(p is not None for p in parts)
    assert math.isclose(whole, sum(p for p in parts if p is not None), rel_tol=1e-9, abs_tol=1e-12)
    assert whole >= 0


@given(st.floats(1.0, 1e7), st.integers(1, 1 << 17))
def test_a_constant_rate_is_tokens_over_rate(rate: float, n: int) -> None:
    got = recompute.prefill_seconds({5: rate}, 0, n)
    assert got is not None and math.isclose(got, n / rate, rel_tol=1e-9)


def test_slower_long_contexts_cost_more_per_token() -> None:
    r = {b: 1000.0 / max(1, b - 8) for b in range(0, 18)}  # slower as the context grows
    first = recompute.prefill_seconds(r, 0, 1024)
    later = recompute.prefill_seconds(r, 1 << 15, (1 << 15) + 1024)
    assert first is not None and later is not None and later > first


@given(rates, st.integers(0, 1 << 40))
def test_restore_time_is_bytes_over_the_nearest_rate(r: dict[int, float], n: int) -> None:
    got = recompute.restore_seconds(r, n)
    assert (got is None) == (not r)


@given(
    st.integers(1, 1 << 20),
    st.integers(0, 1 << 40),
    st.none() | st.floats(0, 1e6),
    st.none() | st.floats(0, 1e6),
    st.none() | st.floats(0, 1e6),
)
def test_the_decision(
    tokens: int, nbytes: int, rs: float | None, ps: float | None, cap: float | None
) -> None:
    d = recompute.decide_cost(tokens, nbytes, "local", restore_s=rs, prefill_s=ps, max_cost=cap)
    if rs is None or (ps is None and cap is None):
        assert d.restore and d.reason == "unmeasured"  # today's behaviour until measured
    elif cap is not None:
        assert d.restore == (rs <= cap) and d.reason == "max_cost"
    else:
        assert ps is not None and d.restore == (rs < ps)
        assert d.reason == ("faster" if d.restore else "slower")
    assert (d.tokens, d.nbytes, d.restore_s, d.prefill_s) == (tokens, nbytes, rs, ps)


@given(
    st.none() | st.integers(0, 5000),
    st.integers(1, 5000),
    st.integers(0, 40),
    st.integers(1, 512),
    st.booleans(),
)
def test_a_partial_read_covers_the_hit_and_no_more(
    keep: int | None, n: int, blocks: int, block: int, split: bool
) -> None:
    need = policy.partial_blocks(keep, n, blocks, block, split)
    if need is None:
        return  # the whole snapshot is read
    assert keep is not None and split and keep < n
    assert need <= blocks and need * block >= keep and (need - 1) * block < max(keep, 1)


def test_an_estimate_is_the_median_of_its_samples_with_an_optimistic_end() -> None:
    assert recompute.rate_of([]) is None and recompute.rate_of([0.0, -1.0]) is None
    one = recompute.rate_of([5.0])
    assert one == recompute.RateEstimate(5.0, 5.0, 1)
    five = recompute.rate_of([1.0, 100.0, 3.0, 2.0, 4.0])  # one fast outlier moves nothing
    assert five == recompute.RateEstimate(3.0, 4.0, 5)
    four = recompute.rate_of([1.0, 1.0, 9.0, 9.0])
    assert four is not None and four.typical == 5.0 and four.best == 9.0


@given(st.lists(st.floats(1e-3, 1e9), min_size=1, max_size=9))
def test_the_optimistic_end_is_never_below_the_median(samples: list[float]) -> None:
    got = recompute.rate_of(samples)
    assert got is not None and min(samples) <= got.typical <= got.best <= max(samples)
    assert got.samples == len(samples)


def test_a_thin_bucket_borrows_its_neighbours_samples() -> None:
    nbytes = 3 << 20  # bucket 22
    b = recompute.rate_bucket(nbytes)
    got = recompute.restore_estimate({b: [1e6], b - 1: [1e9, 1e9], b + 1: [1e9]}, nbytes)
    # 4 samples price it, 2 of its own size or larger stand behind it (smaller ones'
    # rates may understate it: they never make it confident)
    assert got is not None and got.samples == 2 and got.seconds == nbytes / 1e9
    alone = recompute.restore_estimate({b: [1e6, 1e6, 1e6], b + 3: [1e9]}, nbytes)
    assert alone is not None and alone.samples == 3 and alone.seconds == nbytes / 1e6


def test_smaller_restores_never_make_a_larger_one_confident() -> None:
    """Attack 39j: a 1.5 MB hit priced at the rate of 10 KiB restores (2-13 MB/s, their
    fixed costs; 110-200 MB/s measured at its own size) was declined "slower" on 5
    samples in every fresh process, and never measured again (its own bucket had no
    sample to grow stale).  Rates of smaller buckets may price it, never decline it."""
    nbytes = 3 << 20
    b = recompute.rate_bucket(nbytes)
    got = recompute.restore_estimate({b - 8: [2e6] * 5}, nbytes)
    assert got is not None and got.seconds == nbytes / 2e6 and got.samples == 0
    d = recompute.decide_cost(
        6000, nbytes, "local", restore_s=got.seconds, prefill_s=0.3, best_s=got.best,
        samples=got.samples,
    )  # fmt: skip
    assert (d.restore, d.reason) == (True, "learning")
    thin = recompute.restore_estimate({b - 1: [1e6] * 5, b: [1e6]}, nbytes)
    assert thin is not None and thin.samples == 1  # its own bucket's sample only
    above = recompute.restore_estimate({b + 2: [1e6] * 3}, nbytes)
    assert above is not None and above.samples == 3  # a larger one's rate is no slower


def test_a_faster_larger_bucket_bounds_a_slow_estimate() -> None:
    """Restoring fewer bytes never takes longer than the fewest bytes of a larger
    bucket did: one slow bucket next to a 22x faster one up (issue 39)."""
    nbytes = 3 << 20
    b = recompute.rate_bucket(nbytes)
    slow = [1e7] * 5
    got = recompute.restore_estimate({b: slow, b + 1: [2.2e8] * 3}, nbytes)
    assert got is not None and got.seconds == (1 << b) / 2.2e8 < nbytes / 1e7
    thin = recompute.restore_estimate({b: slow, b + 2: [2.2e8] * 2}, nbytes)  # not confident
    assert thin is not None and thin.seconds == nbytes / 1e7


@given(st.dictionaries(st.integers(1, 40), st.lists(st.floats(1.0, 1e12), min_size=1, max_size=5),
                       min_size=1, max_size=6), st.integers(1, 1 << 40))  # fmt: skip
def test_an_estimate_is_positive_and_its_best_no_slower(
    samples: dict[int, list[float]], nbytes: int
) -> None:
    got = recompute.restore_estimate(samples, nbytes)
    assert got is not None and 0 < got.best <= got.seconds
    assert 0 <= got.samples <= sum(len(s) for s in samples.values())


def test_one_slow_sample_never_declines_and_a_confident_one_may_explore() -> None:
    def decide(samples: int, best: float, explore: bool = False) -> recompute.CostDecision:
        return recompute.decide_cost(
            100,
            1 << 20,
            "local",
            restore_s=2.0,
            prefill_s=1.0,
            best_s=best,
            samples=samples,
            explore=explore,
        )

    assert (decide(1, 2.0).restore, decide(1, 2.0).reason) == (True, "learning")
    assert (decide(2, 2.0).restore, decide(2, 2.0).reason) == (True, "learning")
    assert (decide(3, 0.5).restore, decide(3, 0.5).reason) == (True, "uncertain")
    assert (decide(3, 2.0).restore, decide(3, 2.0).reason) == (False, "slower")
    assert (decide(3, 2.0, True).restore, decide(3, 2.0, True).reason) == (True, "explore")
    # a caller's limit is a limit: no learning, no exploring past it
    capped = recompute.decide_cost(
        100, 1, "local", restore_s=2.0, prefill_s=1.0, max_cost=1.5, samples=1, explore=True
    )
    assert (capped.restore, capped.reason) == (False, "max_cost")
    assert (decide(3, 0.5).samples, decide(3, 0.5).best_s) == (3, 0.5)


def test_an_unmeasured_tier_is_bounded_by_the_fastest_confident_one() -> None:
    """After a restart a tier was not measured yet (``local``), while another (``host``)
    was, confidently: a hit that loses to the prefill even at that tier's optimistic
    rate is declined (``bound``), not restored to learn (on the H100 a restart's
    restores of 7,241 tokens took 0.39-0.47 s where memory held 7,073 and plain
    mlx_lm.server prefilled the other 222 in 0.20-0.27 s)."""
    host = {30: [1e9, 1.2e9, 1.1e9]}  # bytes/s in the bucket of 2**29 bytes
    floor = recompute.floor_seconds({"host": host, "local": {30: [5e8]}}, 1 << 29, "local")
    assert floor == pytest.approx((1 << 29) / 1.2e9)  # the optimistic end, of host only
    assert recompute.floor_seconds({"host": {30: [1e9] * 2}}, 1 << 29, "local") is None  # 2 samples
    assert recompute.floor_seconds({}, 1 << 29, "local") is None
    # a smaller size's rate may understate a larger one's (its fixed costs): not asked
    assert recompute.floor_seconds({"host": {20: [1e8] * 3}}, 1 << 29, "local") is None
    bigger = recompute.floor_seconds({"host": {20: [1e8] * 3, 32: [4e9] * 3}}, 1 << 29, "local")
    assert bigger == pytest.approx((1 << 29) / 4e9)
    # a slower tier never bounds a faster one (attack 39j: the host tier's RAM copy was
    # declined at a slow local rate); a fleet tier is bounded by the host and local ones
    slow_local = {"local": {30: [3e5] * 5}}
    assert recompute.floor_seconds(slow_local, 1 << 29, "host") is None
    assert recompute.floor_seconds(slow_local, 1 << 29, "local") is None
    assert recompute.floor_seconds(slow_local, 1 << 29, "local-disk") == pytest.approx(
        (1 << 29) / 3e5
    )
    assert recompute.floor_seconds(slow_local, 1 << 29, "shared") == pytest.approx((1 << 29) / 3e5)

    def decide(rs: float | None, samples: int | None, fl: float | None, **kw: float) -> Any:
        return recompute.decide_cost(
            7241, 1 << 29, "local", restore_s=rs, prefill_s=0.02, samples=samples,
            floor_s=fl, **kw,
        )  # fmt: skip

    d = decide(None, None, 0.45)
    assert (d.restore, d.reason, d.floor_s) == (False, "bound", 0.45)
    assert (decide(0.5, 1, 0.45).restore, decide(0.5, 1, 0.45).reason) == (False, "bound")
    # winnable at the optimistic rate: restored, to be measured, as before
    assert (decide(None, None, 0.01).restore, decide(None, None, 0.01).reason) == (
        True,
        "unmeasured",
    )
    assert (decide(0.5, 1, 0.01).restore, decide(0.5, 1, 0.01).reason) == (True, "learning")
    # a limit the caller names is the limit: no bound past it
    assert (decide(None, None, 0.45, max_cost=1.0).restore) is True


@given(
    st.none() | st.floats(0, 1e3),
    st.none() | st.integers(0, 9),
    st.floats(1e-6, 1e3),
    st.none() | st.floats(0, 1e3),
)
def test_a_bound_declines_only_what_would_lose_at_its_rate(
    rs: float | None, samples: int | None, ps: float, fl: float | None
) -> None:
    d = recompute.decide_cost(
        100, 1 << 20, "local", restore_s=rs, prefill_s=ps, samples=samples, floor_s=fl
    )
    if d.reason == "bound":
        assert fl is not None and fl > ps and not d.restore
    without = recompute.decide_cost(
        100, 1 << 20, "local", restore_s=rs, prefill_s=ps, samples=samples
    )
    if without.reason in ("faster", "slower", "uncertain"):
        assert d == dataclasses.replace(without, floor_s=fl)  # a confident estimate rules
