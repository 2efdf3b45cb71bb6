"""Reliability suite: short in CI; ``PERSIST_LONG=1`` runs the long versions.

Each test records what it did in ``tally`` (trials, faults injected, errors
by type, data lost); with ``PERSIST_RELIABILITY_STATS=FILE`` the totals are
written there for ``bench/bench_reliability.py``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LONG = os.environ.get("PERSIST_LONG") == "1"


def scale(short: int, long: int) -> int:
    return long if LONG else short


class Tally:
    def __init__(self) -> None:
        self.data: dict[str, Counter[str]] = {}

    def add(self, category: str, **counts: int) -> None:
        self.data.setdefault(category, Counter()).update(counts)

    def error(self, category: str, exc: BaseException | None) -> None:
        name = "none" if exc is None else type(exc).__name__
        self.add(category, **{f"error:{name}": 1})


_tally = Tally()


@pytest.fixture(scope="session")
def tally() -> Iterator[Tally]:
    yield _tally
    out = os.environ.get("PERSIST_RELIABILITY_STATS")
    if out:
        Path(out).write_text(json.dumps({k: dict(v) for k, v in _tally.data.items()}, indent=2))


@pytest.fixture(scope="session")
def long_run() -> Any:
    return LONG
