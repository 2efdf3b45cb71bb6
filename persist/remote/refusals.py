"""Telling the operator that a tier refuses operations (out of memory under Redis's
default policy, an ACL, an S3 policy): each refusal fails one operation and
opens no breaker, so without this the fleet's pushes could fail for good
without a line in the log.  The first refusal is logged at once, then at most
one line per ``EVERY_S`` with the count since the last.  No mlx.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["Refusals", "EVERY_S"]

log = logging.getLogger("persist")
EVERY_S = 60.0


class Refusals:
    """The refusals of one tier (``name``: "shared tier URL"), logged at most once
    per ``EVERY_S`` seconds of the tier's clock."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.total = 0  # every refusal (/metrics: persist_tier_refusals_total)
        self._since = 0  # refusals not yet told
        self._next = float("-inf")
        self._lock = threading.Lock()

    def note(self, now: float, what: str, why: str) -> None:
        with self._lock:
            self.total += 1
            self._since += 1
            if now < self._next:
                return
            more, self._since, self._next = self._since - 1, 0, now + EVERY_S
        tail = f" ({more} more since the last such line)" if more else ""
        log.warning(
            "persist: %s refused %s: %s%s; those operations failed (counted in persist "
            "stats and persist_tier_refusals_total)",
            self.name, what, why, tail,
        )  # fmt: skip
