"""Damaged snapshots this thread's lookups skipped.

A lookup that finds a row the index vouches for but whose blobs fail their
checks skips it (never a wrong cache) and goes on.  The index alone cannot
tell: ``Store.explain`` reads no blob, so a request that reused less than the
index offers was judged a hit (attack r14).  ``persist serve`` reads this count
around a request's lookups (``serve.tenant_serving``), on the thread that ran
them, and calls such a verdict ``damaged``.
"""

from __future__ import annotations

import threading

__all__ = ["damaged_skips", "skipped_damaged"]

_local = threading.local()


def skipped_damaged() -> None:
    """Count one damaged snapshot a lookup on this thread skipped."""
    _local.n = getattr(_local, "n", 0) + 1


def damaged_skips() -> int:
    """Damaged snapshots lookups on this thread have skipped so far."""
    return int(getattr(_local, "n", 0))
