"""Ctrl-C during ``persist generate``: the turn so far is kept, then the command exits.

A KeyboardInterrupt raised wherever the signal lands (inside a prefill chunk,
between a token and its cache update, inside a save) can leave nothing worth
saving, and ``generate`` saved nothing at all.  Inside ``deferred_sigint`` the
first Ctrl-C only asks the turn to stop (``Stop``): generation asks between
prefill chunks and after each token, ends there, and the turn so far is saved
as the session's next version.  A second Ctrl-C is the KeyboardInterrupt it
always was (nothing more is saved).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Stop", "deferred_sigint"]


class Stop:
    """Asked by generation: has the user pressed Ctrl-C once?"""

    def __init__(self) -> None:
        self.asked = False

    def __call__(self) -> bool:
        return self.asked


@contextlib.contextmanager
def deferred_sigint() -> Iterator[Stop]:
    """While inside, the first SIGINT sets the Stop it yields; the second raises
    KeyboardInterrupt.  Outside the main thread (no signal handlers there), or where
    SIGINT is ignored (a background job of a shell without job control): no-op."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # a background job: kept so
        yield stop
        return

    def on_sigint(_signum: int, _frame: Any) -> None:
        if stop.asked:
            raise KeyboardInterrupt
        stop.asked = True

    before = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, before)
