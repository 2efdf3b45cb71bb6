"""What the cost model's tests share: a fake clock a slowed tier moves, injected
prefill rates, and a store primed with a session and the rates of computing it
(no verdict depends on machine speed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import persist
from persist.storage.blobs import FileBlobs


class Clock:
    """The cost model's clock: time moves only when a slowed tier says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowBlobs(FileBlobs):
    """The store's own files, each open taking ``delay`` seconds of the fake clock."""

    def __init__(self, root: Path, delay: float, clock: Clock) -> None:
        super().__init__(root)
        self.delay, self.clock = delay, clock

    def open(self, file: str) -> BinaryIO:
        self.clock.now += self.delay
        return super().open(file)


def slowed(store: persist.Store, delay: float) -> persist.Store:
    """Restores from ``store`` take ``delay`` seconds per blob, on the fake clock (the
    model's wall clock too: the age of samples is the test's)."""
    clock = Clock()
    store.costs.clock = store.costs.wall = clock
    store.blobs = SlowBlobs(store.root, delay, clock)
    return store


def learned(store: persist.Store, prompt: list[int], ident: Any, most: int = 8) -> list[str]:
    """Look ``prompt`` up until a hit is declined (at most ``most`` times): the reasons.
    The first restore of a process is kept apart (one-time costs), and fewer than
    policy.recompute.MIN_SAMPLES samples decline nothing."""
    reasons = []
    for _ in range(most):
        hit = store.lookup(prompt, identity=ident)
        assert store.costs.last is not None
        reasons.append(store.costs.last.reason)
        if hit is None:
            break
    return reasons


def prefill_rate(store: persist.Store, tokens_per_second: float) -> persist.Store:
    """Every prefill recorded into ``store`` ran at ``tokens_per_second``, whatever it took."""
    record = store.costs.prefilled

    def at_rate(identity: Any, start: int, end: int, seconds: float) -> None:
        record(identity, start, end, (end - start) / tokens_per_second)

    store.costs.prefilled = at_rate  # type: ignore[method-assign]
    return store


def taught(store: persist.Store, ident: Any, tokens: int = 1024) -> None:
    """Prefills of ``tokens`` tokens measured here (the first is a process's warm-up)."""
    for _ in range(3):
        store.record_prefill(ident, 0, tokens, 1.0)


TINY_PREFILL = 20_000.0  # tokens/s: 600 tokens in 0.03 s


SLOW_PREFILL = 1_000.0  # tokens/s: 600 tokens in 0.6 s


def primed(
    model: Any, tok: Any, root: Path, toks: list[int], rate: float = TINY_PREFILL
) -> persist.Store:
    """A store with a session of ``toks`` and the (injected) prefill rates of computing it."""
    ident = persist.ModelIdentity.of(model, tok)
    store = prefill_rate(persist.Store(root), rate)
    store.costs.clock = Clock()  # local restores take no time until a test slows them
    cache = persist.prefill(model, toks, store=store, identity=ident, step=128)
    store.save(cache, toks, identity=ident, session="doc")
    return store
