"""The bounded explain (what persist serve runs on every miss) does the same SQL work
in a store of 300 chats sharing a system prompt as in one of 30, and still finds the
returning chat's own entry; the full explain reads every row (counted in SQLite VM
steps, never timed)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import persist
from tests.golden.cases import IDENTITY
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
