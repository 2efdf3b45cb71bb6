"""A staged restore in rounds (issue 39): the device holds one round's staging at a
time, so a restore peaks near 1 + 1/ROUNDS times the cache instead of twice it.
Host lanes stand in for the copy engine (tests/host_lanes); the bytes are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import persist
from persist.cuda import pinned
from persist.cuda.pinned import HOST, Choice, Ring
from persist.engine.staged import restore as staging
from tests.helpers import assert_same_state, live_state, prefill, tokens_for
from tests.host_lanes import host_buffers, host_ring, staged
from tests.store_helpers import whole_buffers


@given(st.lists(st.integers(0, 1 << 30), max_size=40), st.integers(0, 1 << 36))
def test_rounds_cover_every_job_once_in_order(sizes: list[int], total: int) -> None:
    got = staging.rounds(sizes, total)
    assert [i for r in got for i in r] == list(range(len(sizes)))
    cap = max(staging.ROUND_MIN, -(-total // staging.ROUNDS))
    for r in got:  # a round holds one job, or no more than its cap
        assert len(r) == 1 or sum(sizes[i] for i in r) <= cap


def test_a_cache_of_many_rounds_peaks_at_a_round() -> None:
    sizes = [32 << 20] * 32  # an 8k Llama-3-8B cache: 32 blobs of 32 MiB
    got = staging.rounds(sizes, sum(sizes))
    biggest = max(sum(sizes[i] for i in r) for r in got)
    assert len(got) >= 8 and biggest / sum(sizes) <= 0.1


class Counting:
    """The bytes of each call for buffers: the restore's capacity-sized buffers first,
    then each round's staging (made, placed and dropped before the next)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, sizes: list[int]) -> list[Any]:
        self.calls.append(sum(sizes))
        return host_buffers(sizes)


@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_a_restore_in_rounds_is_the_host_restore(
    variant: str, tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny(variant)
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(200, seed=21)
    cache, _ = prefill(model, prompt, step=64)
    monkeypatch.setattr(staging, "ROUND_MIN", 1)  # tiny blobs: many rounds
    monkeypatch.setattr(staging, "ROUNDS", 64)
    monkeypatch.setenv("PERSIST_STAGING", "rounds")
    ring = host_ring(3, 4096)
    told: list[tuple[int, int]] = []
    with persist.Store(tmp_path / "s", block_tokens=16) as store:
        store.save(cache, prompt, identity=ident, session="s")
        with pinned.use(Choice(HOST, "test")):
            by_host = store.restore("s", identity=ident).cache
        with staged(ring):
            by_ring = store.restore(
                "s", identity=ident, progress=lambda n, t: told.append((n, t))
            ).cache
    assert_same_state(live_state(by_ring), live_state(cache))
    assert whole_buffers(by_ring) == whole_buffers(by_host)
    jobs = told[-1][1]
    assert [n for n, _ in told] == list(range(1, jobs + 1)) and {t for _, t in told} == {jobs}


def test_each_round_stages_only_its_own_bytes(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(200, seed=22)
    cache, _ = prefill(model, prompt, step=64)
    base = host_ring(3, 4096)
    with persist.Store(tmp_path / "s", block_tokens=16) as store:
        store.save(cache, prompt, identity=ident, session="s")
        peaks = []
        monkeypatch.setenv("PERSIST_STAGING", "rounds")
        for rounds in (1, 64):
            monkeypatch.setattr(staging, "ROUND_MIN", 1)
            monkeypatch.setattr(staging, "ROUNDS", rounds)
            counting = Counting()
            ring = Ring(base.lanes, lambda s, c=counting: c(s), base.scatter)
            with staged(ring):
                got = store.restore("s", identity=ident).cache
            assert_same_state(live_state(got), live_state(cache))
            peaks.append(max(counting.calls[1:]))
            assert (len(counting.calls) == 2) == (rounds == 1)  # buffers, then rounds
    assert peaks[1] * 4 < peaks[0]  # a round's staging, not the whole cache's


def test_rounds_are_taken_only_where_asked_or_short_of_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PERSIST_STAGING", raising=False)
    with pinned.use(Choice(HOST, "test")):  # no driver: no device to be short of
        assert not staging.in_rounds(1 << 40)
    for asked, want in (("rounds", True), ("whole", False)):
        monkeypatch.setenv("PERSIST_STAGING", asked)
        assert staging.in_rounds(1) is want


class Room:
    """A driver that reports ``free`` bytes of device memory."""

    def __init__(self, free: int) -> None:
        self.free = free

    def free_memory(self) -> int:
        return self.free


def test_a_device_short_of_room_stages_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERSIST_STAGING", raising=False)
    gib = 1 << 30
    for free, want in ((10 * gib, False), (gib, True)):
        choice = Choice(HOST, "test", driver=Room(free))  # type: ignore[arg-type]
        with pinned.use(choice):
            assert staging.in_rounds(gib) is want
