"""What a terminal shows: the streamed answer's line, and progress bars that never erase it.

Stdout and stderr share one terminal.  A bar redraws its line with ``\\r``, so
a bar drawn while the answer's last line is open (no newline yet) would
overwrite the answer: ``end_line`` closes that line first.  Bars are drawn
only on an interactive stderr and only for work that lasts (``BAR_AFTER_S``),
so quick saves and restores leave the terminal as the answer left it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

import click

__all__ = ["Bar", "progress", "write_answer", "end_line", "stdout_closed", "BAR_AFTER_S"]

BAR_AFTER_S = 0.5  # work shorter than this draws no bar
WIDTH = 30

_open_line = False  # the answer's last line has no newline yet
_closed = False  # stdout was closed under us (``| head``): the answer is no longer written
_active: Bar | None = None  # a bar drawn and not finished: its line is open too


def write_answer(text: str) -> None:
    """Stream a piece of the answer to stdout; a closed stdout ends the writing, never
    the turn (``stdout_closed`` says so afterwards)."""
    global _open_line
    if text and not _closed:
        try:
            click.echo(text, nl=False)
        except BrokenPipeError:
            _stdout_gone()
            return
        _open_line = not text.endswith("\n")


def stdout_closed() -> bool:
    """Whether stdout was closed while the answer was written (its reader left)."""
    return _closed


def _stdout_gone() -> None:
    """Stop writing to a stdout whose reader left, and point it at /dev/null so a later
    write or the interpreter's final flush stays silent."""
    global _closed, _open_line
    _closed, _open_line = True, False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def end_line() -> None:
    """End the answer's line, or an unfinished bar's, if one is open (before a bar,
    a status line, the next output)."""
    global _open_line
    if _active is not None:
        _active.close()
    if _open_line:
        _open_line = False
        try:
            click.echo()
        except BrokenPipeError:
            _stdout_gone()


class Bar:
    """A progress callback ``(done, total)`` that draws one line on stderr.

    The time left is the rate since the first report (work done before it,
    such as tokens resumed from the store or the first chunk, counts at no
    cost in a simple average and makes the estimate far too short) times
    what is left."""

    def __init__(
        self,
        label: str,
        *,
        file: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        after: float | None = None,
    ) -> None:
        self.label = label
        self.file = file
        self.clock = clock
        self.after = BAR_AFTER_S if after is None else after
        self.started = clock()
        self.first: tuple[float, int] | None = None  # (time, done) of the first report
        self.drawn = False
        self.closed = False

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stderr

    def __call__(self, done: int, total: int) -> None:
        if self.closed or total <= 0:
            return
        now = self.clock()
        if self.first is None:
            self.first = (now, done)
        finished = done >= total
        if not self.drawn:
            if finished or now - self.started < self.after or not self._out().isatty():
                return
            end_line()
            self.drawn = True
            _set_active(self)
        self._draw(done, total, now)
        if finished:
            self.close()

    def left(self, done: int, total: int, now: float) -> float | None:
        """Seconds left at this rate; None until there is a rate to go by."""
        assert self.first is not None
        t0, d0 = self.first
        if done <= d0 or now <= t0:
            return None
        return (now - t0) / (done - d0) * (total - done)

    def _draw(self, done: int, total: int, now: float) -> None:
        frac = min(1.0, done / total)
        filled = int(frac * WIDTH)
        left = self.left(done, total, now)
        eta = "" if left is None or done >= total else f"  {_secs(left)} left"
        line = f"{self.label} [{'#' * filled}{'-' * (WIDTH - filled)}] {frac:4.0%}{eta}"
        out = self._out()
        out.write(f"\r{line}\033[K")
        out.flush()

    def close(self) -> None:
        if self.drawn and not self.closed:
            out = self._out()
            out.write("\n")
            out.flush()
        self.closed = True
        if _active is self:
            _set_active(None)


def _set_active(bar: Bar | None) -> None:
    global _active
    _active = bar


def _secs(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s} s"


def progress(label: str) -> Bar:
    """A progress callback that draws a bar on an interactive stderr, for lasting work."""
    return Bar(label)
