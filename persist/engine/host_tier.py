"""A host-RAM tier: caches a server's in-memory prompt cache evicted, kept in RAM.

mlx-lm's ``LRUPromptCache`` drops a conversation once ``--prompt-cache-size``
(or its byte limit) is reached; asking the durable store for it again costs
a file read and a checksum pass.  ``HostTier`` keeps what was evicted, up
to a byte budget, least recently used first out, and hands it back before
the store is asked.  Every cache handed out is a fresh deep copy: mlx-lm
updates a live cache in place (slice assignment into a buffer it owns
alone), so an alias of the kept entry would corrupt the next hit.

On the CPU (and Metal's unified memory) the kept cache is host memory
already.  On CUDA it belongs in pinned memory (``format.pinned``'s ring);
that copy is not built: this tier keeps the evicted cache objects as they
are, device memory there, so ``persist serve`` turns it off on CUDA unless
``--host-cache`` asks for it.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from ..errors import InvalidArgumentError

__all__ = ["HostTier", "HostHit", "default_budget", "HOST"]

HOST = "host"  # the tier name in rates, metrics and lookups
DEFAULT_CAP = 8 << 30  # bytes: the default budget's ceiling
DEFAULT_SHARE = 0.10  # of MemAvailable


def default_budget(meminfo: str = "/proc/meminfo") -> int:
    """min(10% of MemAvailable, 8 GiB); 0 where MemAvailable cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return min(int(kib * 1024 * DEFAULT_SHARE), DEFAULT_CAP)
    except (OSError, ValueError, IndexError):
        pass  # no /proc (macOS): fall through to sysconf
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0
    return min(int(free * DEFAULT_SHARE), DEFAULT_CAP)


@dataclass(frozen=True)
class HostHit:
    cache: list[Any]  # a fresh copy, evaluated: the caller owns it
    tokens: list[int]  # the prefix of the asked tokens it covers
    nbytes: int
    seconds: float  # the copy, as timed by the tier's clock


@dataclass(frozen=True)
class _Kept:
    cache: list[Any]
    nbytes: int
    tokens: Any  # numpy int64: compared with a prompt in one pass
    trimmable: bool


def _usable(kept: _Kept, toks: Any) -> int:
    """Tokens of ``toks`` the kept cache can serve, at least one left over."""
    n = min(len(kept.tokens), len(toks))
    differ = np.flatnonzero(kept.tokens[:n] != toks[:n])
    common = int(differ[0]) if differ.size else n
    if common == len(kept.tokens) and common < len(toks):
        return common  # it covers a prefix as it is
    return min(common, len(toks) - 1) if kept.trimmable else 0


def _nbytes(cache: Sequence[Any]) -> int:
    return int(sum(c.nbytes for c in cache))


def _fresh(cache: Sequence[Any]) -> list[Any]:
    """A deep copy with every array evaluated: no lazy graph points back at the kept one."""
    out = copy.deepcopy(list(cache))
    mx.eval([a for c in out for a in c.state if isinstance(a, mx.array)])
    return out


class HostTier:
    """Evicted caches by (model digest, tokens), LRU by bytes under ``max_bytes``.

    Thread-safe: mlx-lm's generation thread keeps and fetches; /metrics reads.
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgumentError(f"the host cache's size is bytes, at least 0: {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], _Kept] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.kept = self.evicted = 0
        self.clock = time.perf_counter  # tests inject one: no timing verdicts

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, digest: str, tokens: Sequence[int], cache: Sequence[Any]) -> bool:
        """Keep an evicted cache (the caller gives it up); False if it cannot fit."""
        n = _nbytes(cache)
        if n > self.max_bytes or not tokens:
            return False
        key = (digest, tuple(int(t) for t in tokens))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            kept = _Kept(list(cache), n, np.asarray(key[1]), can_trim_prompt_cache(list(cache)))
            self._entries[key] = kept
            self.nbytes += n
            self.kept += 1
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes
                self.evicted += 1
        return True

    def fetch(self, digest: str, tokens: Sequence[int], longer_than: int = 0) -> HostHit | None:
        """The longest usable kept prefix of ``tokens`` (one token at least left over),
        longer than ``longer_than``, as a fresh copy; its entry becomes most recent.

        Usable: a kept cache whose tokens begin ``tokens``, or, if it can be
        trimmed, the part it shares with them (a conversation's next turn
        differs where the client's text of the last answer begins), as
        mlx-lm's own cache does."""
        toks = np.asarray([int(t) for t in tokens], dtype=np.int64)
        with self._lock:
            best, use = None, longer_than
            for key, kept in self._entries.items():
                if key[0] == digest:
                    n = _usable(kept, toks)
                    if n > use:
                        best, use = key, n
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(best)
            kept = self._entries[best]
            self.hits += 1
            t0 = self.clock()
            fresh = _fresh(kept.cache)  # under the lock: an eviction cannot free it mid-copy
            if use < len(best[1]):
                trim_prompt_cache(fresh, len(best[1]) - use)
            seconds = self.clock() - t0
        return HostHit(fresh, [int(t) for t in toks[:use]], kept.nbytes, seconds)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes": self.nbytes,
                "budget_bytes": self.max_bytes,
                "entries": len(self._entries),
                "hits": self.hits,
                "misses": self.misses,
                "kept": self.kept,
                "evicted": self.evicted,
            }


class EvictionWatch:
    """mlx-lm's prompt trie, with every ``pop`` (an eviction) reported first.

    ``LRUPromptCache`` evicts through ``_trie.pop`` only (its ``insert_cache``
    and ``trim_to``); dropping the prefixes a longer trimmable cache covers
    goes through ``pop_prefixes``, which is no loss and is not reported.
    """

    def __init__(self, trie: Any, on_evict: Any) -> None:
        self._trie, self._on_evict = trie, on_evict

    def pop(self, model: Any, tokens: Any) -> Any:
        entry = self._trie.pop(model, tokens)
        self._on_evict(model, list(tokens), entry.prompt_cache)
        return entry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trie, name)
