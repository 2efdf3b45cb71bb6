"""Background work that gives way to requests.

A thread doing work nobody waits for (``persist serve``'s write-behind and its
host-tier keeper) runs it inside ``giving_way(wait)``; the long loops of that
work (a capture's device copies and reads, a save's blob writes) call
``pause()`` between their pieces, and ``wait`` holds them there while a
request is in its prompt phase (``serve.quiet.RequestGate``).  In every other
thread ``pause`` does nothing.  Why: a save's copies and writes beside a
prefill or a restore slow both (issue 39, on an H100: a lookup beside a save
took 0.4-0.6 s, alone 0.08 s).  No mlx, no numpy: every layer may call it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["giving_way", "pause"]

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
