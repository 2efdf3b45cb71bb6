"""mlx-lm's in-memory prompt cache (``--prompt-cache-size``) in persist serve evicts
as the store and the host tier do under retention hints: among the entries of the
namespace mlx-lm would take one from, a ttl still running protects an entry and a
lower priority goes first; without hints, mlx-lm's own order.  A tenant's hints
never make another tenant's entry go.  Real tiny-model caches, a real store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import LRUPromptCache

import persist
from persist.serve.memory_order import HintedOrder
from persist.serve.server import PersistentPromptCache
from persist.serve.tenants import Scoped
from tests.helpers import prefill, tokens_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def memory(tiny: Any, tmp_path: Path) -> Iterator[tuple[PersistentPromptCache, Any, Clock]]:
    """A memory of three entries, its model, and the clock its hints are read by."""
    model, tok, _ = tiny("llama")
    clock = Clock()
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(
            3, store=store, identity=persist.ModelIdentity.of(model, tok), clock=clock
        )
        try:
            yield pc, model, clock
        finally:
            pc.close()


def put(pc: PersistentPromptCache, model: Any, key: Any, seed: int, hints: Any = None) -> list[int]:
    toks = tokens_for(20, seed)
    pc.insert_cache(key, toks, prefill(model, toks)[0], hints=hints)
    return toks


def held(pc: PersistentPromptCache, key: Any, toks: list[int]) -> bool:
    """Does memory itself (mlx-lm's trie, no other tier) hold exactly ``toks``?"""
    return LRUPromptCache.fetch_nearest_cache(pc, key, toks)[1] == []


def test_a_running_ttl_keeps_an_entry_mlx_lm_would_evict(memory: Any) -> None:
    pc, model, _ = memory
    agent = put(pc, model, "m", 1, hints=(3600.0, 0))  # the oldest: mlx-lm's first victim
    one_offs = [put(pc, model, "m", s) for s in (2, 3, 4)]
    assert held(pc, "m", agent)
    assert not held(pc, "m", one_offs[0]) and held(pc, "m", one_offs[2])


def test_a_lower_priority_goes_first(memory: Any) -> None:
    pc, model, _ = memory
    high = put(pc, model, "m", 1, hints=(0.0, 5))
    low = put(pc, model, "m", 2, hints=(0.0, -1))
    plain = put(pc, model, "m", 3)
    put(pc, model, "m", 4)
    assert not held(pc, "m", low)
    assert held(pc, "m", high) and held(pc, "m", plain)


def test_a_lapsed_ttl_protects_nothing(memory: Any) -> None:
    pc, model, clock = memory
    agent = put(pc, model, "m", 1, hints=(60.0, 0))
    put(pc, model, "m", 2)
    put(pc, model, "m", 3)
    clock.now += 61  # its ttl ran out: mlx-lm's order again
    put(pc, model, "m", 4)
    assert not held(pc, "m", agent)


def test_a_tenants_hints_never_evict_another_tenants_entry(memory: Any) -> None:
    pc, model, _ = memory
    a, b = Scoped("m", "default/tenant:a"), Scoped("m", "default/tenant:b")
    b_hinted = put(pc, model, b, 1, hints=(3600.0, 0))  # the oldest: mlx-lm's victim is b's
    a_plain = put(pc, model, a, 2)
    b_plain = put(pc, model, b, 3)
    put(pc, model, a, 4)
    assert held(pc, a, a_plain) and held(pc, b, b_hinted)
    assert not held(pc, b, b_plain)  # b gives up its own unhinted entry


OPS = st.lists(
    st.tuples(
        st.sampled_from(["push", "remove", "pop"]),
        st.integers(0, 5),  # which entry
        st.sampled_from(["assistant", "user", "system"]),
    ),
    max_size=40,
)


@given(OPS)
def test_without_hints_the_order_is_mlx_lm_s_own(ops: list[tuple[str, int, str]]) -> None:
    """HintedOrder reads mlx-lm's ``CacheOrder`` internals (``_lrus``, ``_ordering``) and
    re-states its ``pop`` rule; any mlx-lm change to them fails here, by name: the same
    pushes, removes and pops give the same victims as mlx-lm's own order."""
    ours = HintedOrder(lambda *_: None, lambda key: "ns", lambda: 0.0)
    theirs = LRUPromptCache.CacheOrder()
    held: set[int] = set()
    for op, i, kind in ops:
        tokens = [i, i + 1]
        if op == "push" and i not in held:
            ours.push("m", tokens, kind)
            theirs.push("m", tokens, kind)
            held.add(i)
        elif op == "remove" and i in held:
            ours.remove("m", tokens)
            theirs.remove("m", tokens)
            held.discard(i)
        elif op == "pop" and held:
            a, b = ours.pop(), theirs.pop()
            assert (a[0], list(a[1])) == (b[0], list(b[1]))
            held.discard(a[1][0])
        assert len(ours) == len(theirs)
