"""Property tests of the pure resume policy (no disk, no mlx)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from persist import policy, servable
from persist.policy import Candidate, EvictEntry


@given(
    st.integers(0, 500),
    st.integers(0, 500),
    st.integers(0, 500),
    st.booleans(),
    st.integers(0, 500),
)
def test_usable_prefix_rules(
    stored: int, lcp: int, prompt: int, trimmable: bool, floor: int
) -> None:
    lcp = min(lcp, stored, prompt)
    p = policy.usable_prefix(stored, lcp, prompt, trimmable, floor)
    if p:
        assert 0 < p <= lcp and p < prompt  # a token is left to produce logits
        assert p >= floor  # never below an irreversible transition
        assert trimmable or p == stored  # untrimmable state only at its own length
    elif lcp == stored and stored < prompt and stored >= max(floor, 1):
        raise AssertionError("an exact, long enough prefix must be usable")


@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.booleans(), st.integers(0, 300), st.integers(0, 300)),
        max_size=8,
    ),
    st.integers(2, 300),
)
def test_choose_takes_the_longest_usable(
    rows: list[tuple[int, bool, int, int]], prompt: int
) -> None:
    cands = [
        (Candidate(i, n, t, f, float(i)), min(lcp, n)) for i, (n, t, f, lcp) in enumerate(rows)
    ]
    best = policy.best_candidate(cands, prompt)
    usable = [
        policy.usable_prefix(c.stored_len, lcp, prompt, c.trimmable, c.min_resume)
        for c, lcp in cands
    ]
    if best is None:
        assert not any(usable)
    else:
        assert best.prefix == max(usable) > 0


@given(st.integers(1, 100), st.booleans(), st.integers(0, 100), st.integers(1, 100), st.booleans())
def test_untrimmable_never_supersedes(
    new_len: int, trimmable: bool, floor: int, old_len: int, prefix: bool
) -> None:
    ok = policy.supersedes(new_len, trimmable, floor, old_len, prefix)
    if ok:
        assert trimmable and prefix and old_len <= new_len and floor <= old_len
    if not trimmable:
        assert not ok


@given(
    st.lists(
        st.tuples(
            st.floats(0, 100),
            st.booleans(),
            st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=4),
        ),
        max_size=10,
    ),
    st.integers(0, 400),
)
def test_eviction_is_lru_and_respects_pins(
    rows: list[tuple[float, bool, list[str]]], budget: int
) -> None:
    sizes = {c: 10 * (ord(c) - 96) for c in "abcdefgh"}
    entries = [EvictEntry(i, u, pin, tuple(bl)) for i, (u, pin, bl) in enumerate(rows)]
    out = policy.plan_eviction(entries, sizes, budget)
    by_id = {e.id: e for e in entries}
    assert all(not by_id[i].pinned for i in out)
    kept = [e for e in entries if e.id not in out]
    total = sum(sizes[b] for b in {b for e in kept for b in e.blobs})
    evictable_left = [e for e in kept if not e.pinned]
    assert total <= budget or not evictable_left
    used = [by_id[i].used for i in out]
    assert used == sorted(used)  # least recently used first


@given(
    st.integers(0, 300),
    st.booleans(),
    st.one_of(st.none(), st.integers(0, 300)),
    st.integers(1, 300),
    st.integers(0, 300),
    st.integers(1, 400),
    st.booleans(),
)
def test_a_quantized_snapshot_never_serves_the_plain_positions(
    floor: int, quantized: bool, start: int | None, stored: int, lcp: int, prompt: int, trim: bool
) -> None:
    """Under an identity that quantizes from ``start``, no prefix of ``start`` tokens
    or fewer is taken from a quantized snapshot; everything else is as before."""
    got = servable.kv_bits_floor(floor, quantized, start)
    assert got >= floor
    if not quantized or start is None:
        assert got == floor
    p = policy.usable_prefix(stored, lcp, prompt, trim, got)
    if quantized and start is not None:
        assert p == 0 or p > start
    c = policy.Candidate(1, stored, trim, got)
    assert policy.could_serve(c, 0, prompt) or p == 0
