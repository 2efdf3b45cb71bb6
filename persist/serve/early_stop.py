"""A stop signal before ``persist serve`` answers: an orderly stop, not a kill.

Loading a model, building its kernels and pinning the host tier take seconds to
minutes, and SIGTERM (systemd's stop, a supervisor's) can come then.  Python's
default ended the process at once (exit -15, no log line: attack 39j).  Raising
from the signal handler is no better: landing inside a C extension's import
(MLX's), the exception aborted the process.  So from the CLI command's first
line a SIGTERM is only noted (``EarlyStop``), and the start acts on it at its
safe points (``check``: after the imports, before and after the model's load
and warm-up), raising ``StoppedAtStart`` from plain code: the CLI logs it and
exits 0.  Once mlx-lm's generation thread starts, nothing may unwind past it (a
running non-daemon thread holds the process at exit), so SIGINT is noted too
until ``http_edge.serve_until_signal`` has its own handlers and stops at once,
in order.  A SIGINT before that is Ctrl-C as everywhere else: "interrupted", 130.
A second signal stops at once (128 + its number), as after the server listens.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

__all__ = ["StoppedAtStart", "EarlyStop", "early_stop", "exiting"]


class StoppedAtStart(KeyboardInterrupt):
    """SIGTERM came before the server answered anything: stopped in order, exit 0."""


class EarlyStop:
    """SIGTERM (and, after ``defer_interrupts``, SIGINT) noted, not acted on."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._install(signal.SIGTERM)

    def _install(self, sig: signal.Signals) -> None:
        if threading.current_thread() is threading.main_thread():  # nowhere else
            signal.signal(sig, self._note)

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:  # a second one: at once, as after the server listens
            logging.getLogger("persist").warning("persist: second signal, stopping at once")
            os._exit(128 + signum)
        self.signum = signum

    def defer_interrupts(self) -> None:
        """SIGINT is noted from now on too (the generation thread is about to start)."""
        self._install(signal.SIGINT)

    def pending(self) -> str | None:
        """The name of the signal noted, if one came."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def check(self) -> None:
        """StoppedAtStart if a stop signal was noted: called where nothing is half done."""
        name = self.pending()
        if name is not None:
            raise StoppedAtStart(name)


_current: EarlyStop | None = None


def exiting() -> None:
    """The stop is done and the process exits: a signal from now on is ignored (the
    interpreter puts the default action back as it finalizes, and a supervisor's
    repeated SIGTERM then killed a process that had stopped in order)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)


def early_stop() -> EarlyStop:
    """This process's EarlyStop (made, and SIGTERM noted from now on, at the first call)."""
    global _current
    if _current is None:
        _current = EarlyStop()
    return _current
