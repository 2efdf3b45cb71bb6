"""Ctrl-C during ``persist generate``: the turn so far is kept, then the command exits;
and Ctrl-C once a command's work is committed: exit 130, saying what was kept.

A KeyboardInterrupt raised wherever the signal lands (inside a prefill chunk,
between a token and its cache update, inside a save) can leave nothing worth
saving, and ``generate`` saved nothing at all.  Inside ``deferred_sigint`` the
first Ctrl-C only asks the turn to stop (``Stop``): generation asks between
prefill chunks and after each token, ends there, and the turn so far is saved
as the session's next version.  A second Ctrl-C is the KeyboardInterrupt it
always was (nothing more is saved).

Round 5 (attack 38b): a Ctrl-C just after ``persist import`` printed its
success killed the process by the signal (exit status -2, no message): it
landed while the process exited, where Python's own handler is gone.  A
write command says what it committed (``committed``): an interrupt from then
on is "persist: interrupted; <what was kept>", exit 130.  Once the command
returned (``finishing``) a Ctrl-C exits at once: 130 and that line after a
success, the command's own status after a failure; in the interpreter's last
steps it is ignored.  Never a death by the signal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "PROGRAM",
    "Stop",
    "committed",
    "deferred_sigint",
    "finishing",
    "forget_committed",
    "interrupted_line",
]

PROGRAM = {"on": False}  # set by persist.cli.main: the process is persist's own, not a test's
_kept: list[str] = []  # what the command running has committed, in words


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


def committed(what: str) -> None:
    """Said by a write command once its work is committed (``what``: "session 'x'
    was imported (48 tokens)"): an interrupt from here on names it."""
    _kept[:] = [what]


def forget_committed() -> None:
    _kept.clear()


def interrupted_line() -> str:
    """What an interrupted command says, after ``persist: ``."""
    return f"interrupted; {_kept[0]}, committed before the interrupt" if _kept else "interrupted"


def finishing(code: int) -> None:
    """From here the process only exits with ``code``: a Ctrl-C ends it at once, as
    130 with ``interrupted_line()`` after a success (its work is done, and said so),
    else with ``code``.  Once the exit hooks run it is ignored: Python puts the
    default action back for its last steps, a death by the signal.  Only in
    persist's own process (``PROGRAM``), from the main thread."""
    if not PROGRAM["on"] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # a background job: kept so
        return

    def late(_signum: int, _frame: Any) -> None:
        with contextlib.suppress(Exception):  # the answer first, whole
            sys.stdout.flush()
        if code == 0:
            done = (
                interrupted_line() if _kept else "interrupted after it finished; its work is done"
            )
            with contextlib.suppress(OSError):
                os.write(2, f"persist: {done}\n".encode())
        os._exit(130 if code == 0 else code)

    signal.signal(signal.SIGINT, late)
    atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
