"""Background work that gives way to requests.

A thread doing work nobody waits for (``persist serve``'s write-behind and its
host-tier keeper) runs it inside ``giving_way(wait)``; the long loops of that
work (a capture's device copies and reads, a save's blob writes) call
``pause()`` between their pieces, and ``wait`` holds them there while a
request is in its prompt phase (``serve.quiet.RequestGate``).  In every other
thread ``pause`` does nothing.  Why: a save's copies and writes beside a
prefill or a restore slow both (issue 39, on an H100: a lookup beside a save
took 0.4-0.6 s, alone 0.08 s).

``committing(first, then)`` names work that must read the store before this
thread's next save commits: a save runs its commit inside ``at_commit()``,
which calls ``first`` before it and ``then`` once it ended (the write-behind
judges lookups' verdicts there, against the store their lookups saw, and no
lookup begins in between: ``serve.judgements``).  No mlx, no numpy: every layer may call it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["at_commit", "committing", "giving_way", "pause"]

_local = threading.local()


@contextlib.contextmanager
def giving_way(wait: Callable[[], None]) -> Iterator[None]:
    """Within this block, this thread's ``pause()`` calls ``wait``."""
    before = getattr(_local, "wait", None)
    _local.wait = wait
    try:
        yield
    finally:
        _local.wait = before


def pause() -> None:
    """A point where this thread's background work may wait for requests to pass."""
    wait = getattr(_local, "wait", None)
    if wait is not None:
        wait()


@contextlib.contextmanager
def committing(first: Callable[[], None], then: Callable[[], None] | None = None) -> Iterator[None]:
    """Within this block, this thread's ``at_commit()`` calls ``first`` before a
    commit and ``then`` once it ended."""
    before = getattr(_local, "first", None), getattr(_local, "then", None)
    _local.first, _local.then = first, then
    try:
        yield
    finally:
        _local.first, _local.then = before


@contextlib.contextmanager
def at_commit() -> Iterator[None]:
    """Around a save's commit: what must read the store without it runs first, and
    what waits for its end runs after (committed or not); in every thread outside
    ``committing``, nothing."""
    first, then = getattr(_local, "first", None), getattr(_local, "then", None)
    if first is not None:
        first()
    try:
        yield
    finally:
        if then is not None:
            then()
