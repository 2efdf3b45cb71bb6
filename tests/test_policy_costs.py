"""The restore-or-recompute rule (``persist.policy``): pure functions, Hypothesis."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from persist import policy

rates = st.dictionaries(st.integers(0, 40), st.floats(1e-3, 1e12), max_size=8)


def test_buckets_are_powers_of_two() -> None:
    assert [policy.rate_bucket(n) for n in (0, 1, 2, 3, 4, 255, 256, 1 << 20)] == [
        0, 1, 2, 2, 3, 8, 9, 21,
    ]  # fmt: skip


@given(rates, st.integers(0, 1 << 18), st.integers(0, 1 << 18), st.integers(0, 1 << 18))
def test_prefill_time_adds_up_over_a_split(r: dict[int, float], a: int, b: int, c: int) -> None:
    lo, mid, hi = sorted((a, b, c))
    whole = policy.prefill_seconds(r, lo, hi)
    if not r:
        assert whole is None
        return
    parts = policy.prefill_seconds(r, lo, mid), policy.prefill_seconds(r, mid, hi)
    assert whole is not None and all(p is not None for p in parts)
    assert math.isclose(whole, sum(p for p in parts if p is not None), rel_tol=1e-9, abs_tol=1e-12)
    assert whole >= 0


@given(st.floats(1.0, 1e7), st.integers(1, 1 << 17))
def test_a_constant_rate_is_tokens_over_rate(rate: float, n: int) -> None:
    got = policy.prefill_seconds({5: rate}, 0, n)
    assert got is not None and math.isclose(got, n / rate, rel_tol=1e-9)


def test_slower_long_contexts_cost_more_per_token() -> None:
    r = {b: 1000.0 / max(1, b - 8) for b in range(0, 18)}  # slower as the context grows
    first = policy.prefill_seconds(r, 0, 1024)
    later = policy.prefill_seconds(r, 1 << 15, (1 << 15) + 1024)
    assert first is not None and later is not None and later > first


@given(rates, st.integers(0, 1 << 40))
def test_restore_time_is_bytes_over_the_nearest_rate(r: dict[int, float], n: int) -> None:
    got = policy.restore_seconds(r, n)
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
    d = policy.decide_cost(tokens, nbytes, "local", rs, ps, cap)
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
