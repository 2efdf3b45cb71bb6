"""What this process knows of the blobs on one tier: which keys it saw holding the
right value (so an ordinary push reads an existing blob once, not on every save) and
which it saw holding a wrong one (so the next push overwrites them).  No mlx.

Blobs are written write-once (SET NX, If-None-Match), so a key that is taken looks
present to a push whatever its value: one a hostile writer planted or corrupted
would block the cache for good.  A push therefore reads a taken key once per
process and compares it with what it would write (``RedisTier.blob_matches``);
both sets are bounded, so a long-lived server forgets the oldest and reads it again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["BlobMarks", "GOOD_KEYS", "BAD_KEYS"]

GOOD_KEYS = 1 << 16  # blob keys remembered as verified good (an LRU)
BAD_KEYS = 1 << 12  # blob keys remembered as holding a wrong value until repaired


class BlobMarks:
    def __init__(self, good: int = GOOD_KEYS, bad: int = BAD_KEYS) -> None:
        self._good: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._bad: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._most = (good, bad)
        self._lock = threading.Lock()  # blobs move on several threads

    def is_good(self, namespace: str, name: str) -> bool:
        with self._lock:
            k = (namespace, name)
            if k in self._bad or k not in self._good:
                return False
            self._good.move_to_end(k)
            return True

    def good(self, namespace: str, name: str) -> None:
        """The tier holds this blob's right value (this process wrote or read it)."""
        with self._lock:
            k = (namespace, name)
            self._bad.pop(k, None)
            self._good[k] = None
            self._good.move_to_end(k)
            while len(self._good) > self._most[0]:
                self._good.popitem(last=False)

    def bad(self, namespace: str, name: str) -> None:
        """A read found a value that fails its checks: the next push overwrites it."""
        with self._lock:
            k = (namespace, name)
            self._good.pop(k, None)
            self._bad[k] = None
            while len(self._bad) > self._most[1]:
                self._bad.popitem(last=False)
