"""The bounded explain (what persist serve runs on every miss) does the same SQL work
in a store of 300 chats sharing a system prompt as in one of 30, and still finds the
returning chat's own entry; the full explain reads every row (counted in SQLite VM
steps, never timed)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

import persist
from tests.golden.cases import IDENTITY, arr
from tests.golden.cases import kv_cache as kv
from tests.store_helpers import steps

SYSTEM = list(range(1000, 1300))  # one full block of 256 and 44 tokens of the next
BASE = [kv(340, 1), kv(340, 3)]


def chat(i: int) -> list[int]:
    r = random.Random(i)
    return SYSTEM + [r.randrange(2000, 60000) for _ in range(40)]


def grow(store: persist.Store, start: int, stop: int) -> None:
    for i in range(start, stop):
        store.save(BASE, chat(i), identity=IDENTITY, session=f"chat{i}")


def explain_steps(store: persist.Store, bounded: bool) -> tuple[int, Any]:
    prompt = chat(7) + [5, 6, 7]  # chat 7 returns
    got: list[Any] = []
    n = steps(store, lambda: got.append(store.explain(prompt, identity=IDENTITY, bounded=bounded)))
    return n, got[0]


def test_a_bounded_explain_reads_the_same_few_rows_at_any_size(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s") as store:
        grow(store, 0, 30)
        small, got = explain_steps(store, bounded=True)
        full_small, _ = explain_steps(store, bounded=False)
        grow(store, 30, 300)
        big, got_big = explain_steps(store, bounded=True)
        full_big, want = explain_steps(store, bounded=False)
    for e in (got, got_big, want):
        assert e.best is not None and (e.best.session, e.best.usable) == ("chat7", 340)
    assert big < small * 1.5, (small, big)
    assert full_big > full_small * 5, (full_small, full_big)  # what the bound avoids


def hybrid(n: int, seed: int) -> list[Any]:
    """A hybrid model's cache of ``n`` tokens: a KV layer and a recurrent state, which
    serves only its own length (no cut)."""
    state = ArraysCache(1)
    state[0] = arr(seed, (1, 3, 4), mx.float32)
    return [kv(n, seed), state]


def test_explain_finds_the_best_row_however_many_rows_share_the_prefix(tmp_path: Path) -> None:
    """The system prompt's checkpoint (a hybrid model's: only its own length serves) is
    older than 70 chats that continue it; a prompt asking something new reuses the
    checkpoint, as the lookup does, whichever rows explain reads."""
    prompt = SYSTEM + [65000 + i for i in range(20)]  # sorts after every chat's tail
    with persist.Store(tmp_path / "s") as store:
        store.save(hybrid(len(SYSTEM), 1), SYSTEM, identity=IDENTITY, session="system")
        for i in range(70):
            store.save(hybrid(len(SYSTEM) + 40, 2), chat(i), identity=IDENTITY, session=f"c{i}")
        hit = store.lookup(prompt, identity=IDENTITY, max_cost=float("inf"))
        assert hit is not None and len(hit.tokens) == len(SYSTEM)
        for bounded in (True, False):
            got = store.explain(prompt, identity=IDENTITY, bounded=bounded)
            assert got.best is not None, (bounded, got.message)
            assert (got.best.session, got.best.usable) == ("system", len(SYSTEM)), bounded
