"""Each request's prompt counted once on ``/metrics``, however many lookups served it.

A request with a public segment (``serve.tenant_serving``) is looked up in
its tenant's namespace and then, when that holds less, in the public one.
Each lookup reports what it served (an ``Outcome``: the prompt's tokens,
those served, each source asked); while a request's lookups are held, only
the one whose cache is handed out is counted, with the whole prompt's
length.  What each lookup did (bytes read, restore times, decisions) is
counted where it happens: it happened either way.  Pure: no mlx.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Outcome", "Outcomes"]


@dataclass(frozen=True)
class Outcome:
    """One lookup: the prompt's tokens, the tokens it served, and each source it asked
    with whether that source served it."""

    prompt: int
    cached: int
    sources: tuple[tuple[str, bool], ...]


class Outcomes:
    """Where lookups report their outcome: counted at once (``count``), or held while
    a request's lookups run on this thread (``holding``)."""

    def __init__(self, count: Callable[[Outcome], None]) -> None:
        self._count = count
        self._here = threading.local()

    def report(self, outcome: Outcome) -> None:
        held = getattr(self._here, "held", None)
        if held is None:
            self._count(outcome)
        else:
            held.append(outcome)

    @contextlib.contextmanager
    def holding(self) -> Iterator[list[Outcome]]:
        """Hold what lookups on this thread report, in the list yielded."""
        before = getattr(self._here, "held", None)
        out: list[Outcome] = []
        self._here.held = out
        try:
            yield out
        finally:
            self._here.held = before

    def count_once(self, seen: list[Outcome], prompt: int, cached: int) -> None:
        """Count the lookup whose cache a request got (the last of ``seen``, else of
        the request's other lookups; none when each failed before reporting) as a
        ``prompt`` of that many tokens, ``cached`` of them served."""
        if seen:
            self._count(dataclasses.replace(seen[-1], prompt=prompt, cached=cached))
