"""What this server process already stored or queued, so a cache of the same tokens
is not captured again (issue 39: a request that gains nothing costs nothing).

mlx-lm inserts a cache after every request; an identical request answered the
same way (greedy decoding, a retried call) inserts the same tokens again, and
capturing it read the whole cache back on the generation thread for a save
that wrote nothing new.  Keys are digests of (model digest, namespace, tokens),
a bounded LRU: a key forgotten is captured again, never lost.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KeptKeys"]

KEEP = 4096  # keys remembered (a few hundred KiB)


class KeptKeys:
    """A bounded set of stored (or queued) cache keys; thread-safe."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(digest: str, namespace: str, tokens: Sequence[int]) -> bytes:
        """The digest of one cache's identity, namespace and exact tokens."""
        h = hashlib.blake2b(digest_size=20)
        for part in (digest, namespace):
            raw = part.encode("utf-8", "surrogatepass")
            h.update(len(raw).to_bytes(8, "little") + raw)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, key: bytes) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.keep:
                self._keys.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
