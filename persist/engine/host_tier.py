"""A host-RAM tier: caches kept in RAM, by (owner, tokens), asked before the store.

Two keepers use it.  ``persist serve`` keeps what mlx-lm's ``LRUPromptCache``
evicts (``--prompt-cache-size`` or its byte limit reached): asking the
durable store for it again costs a file read and a checksum pass.
``persist.Store(root, host_cache=N)`` keeps a copy of every save that may
serve lookups (``engine.host_store``).  Up to a byte budget, least recently
used first out.

Entries are kept as codec records (``persist.codecs``) and served by the
resume policy the durable index uses (``policy.choose``: the longest usable
prefix, at least one token left over, never below a snapshot's floor, an
untrimmable one only at its own length, then an exact length, then the most
recent), cut by the codecs' ``trim_record`` as a durable partial hit is.
Every hit is rebuilt from a copy in buffers of its own: mlx-lm updates a
live cache in place and a caller may write one through a memoryview, so
nothing handed out shares memory with what is kept (``copy.deepcopy`` of an
``mx.array`` shares its buffer, which is why it is not used).

On the CPU (and Metal's unified memory) the kept cache is host memory
already.  On CUDA it belongs in pinned memory (``format.pinned``'s ring);
that copy is not built: entries live where MLX puts them, device memory
there, so ``persist serve`` turns the tier off on CUDA unless
``--host-cache`` asks for it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .. import policy
from ..codecs import capacity_of, encode_cache, facts_of, trim_record
from ..codecs.base import dtype_name, with_capacity
from ..codecs.snapshot import Snapshot, rebuild
from ..errors import InvalidArgumentError
from ..format.tensors import device_copy
from ..marks import carries_unverified
from ..records import Record

__all__ = ["HostTier", "HostHit", "default_budget", "HOST"]

HOST = "host"  # the tier name in rates, metrics, lookups and Restored.source
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
    cache: list[Any]  # rebuilt from a copy, evaluated: the caller owns it
    tokens: list[int]  # the prefix of the asked tokens it covers
    nbytes: int  # bytes copied
    seconds: float  # the copy, as timed by the tier's clock
    info: Any = None  # what the keeper attached (the Store: the save's EntryInfo)


@dataclass
class _Kept:
    id: int
    records: list[Record]
    nbytes: int
    tokens: Any  # numpy int64: compared with a prompt in one pass
    trimmable: bool
    min_resume: int
    sticky: bool  # a checkpoint: kept even when a longer entry covers it
    info: Any
    used: int = 0


def _arrays(records: Sequence[Record]) -> list[Any]:
    out: list[Any] = []
    for r in records:
        out += [t for t in r.tensors.values() if isinstance(t, mx.array)]
        out += _arrays(r.children)
    return out


def _own(a: Any) -> Any:
    """``a`` in a buffer of its own (bit-exact); an empty array has no buffer to share."""
    if not isinstance(a, mx.array) or a.size == 0:
        return a
    if a.dtype == mx.bool_:
        return mx.logical_or(a, mx.array(False))
    return device_copy(a)


def _copied(r: Record) -> Record:
    return dataclasses.replace(
        r,
        tensors={k: _own(v) for k, v in r.tensors.items()},
        children=tuple(_copied(c) for c in r.children),
    )


def _handed_out(r: Record) -> Record:
    """``r`` in buffers of its own, each written once: a tensor the codec gives room
    (``capacity_of``: a KV cache's step-rounded buffer) is grown into a new one, as
    ``loading`` reads it into one, and its decode takes it as it is; the rest are
    copied (a decode may keep a record's tensor as its cache's array)."""
    caps = capacity_of(r.spec(dtype_name))
    tensors = {}
    for k, v in r.tensors.items():
        cap = caps.get(k)
        grow = cap is not None and isinstance(v, mx.array) and v.ndim > 2 and cap > v.shape[2]
        tensors[k] = with_capacity(v, cap) if grow and cap is not None else _own(v)
    return dataclasses.replace(
        r, tensors=tensors, children=tuple(_handed_out(c) for c in r.children)
    )


def _common(kept: Any, toks: Any) -> int:
    n = min(len(kept), len(toks))
    differ = np.flatnonzero(kept[:n] != toks[:n])
    return int(differ[0]) if differ.size else n


class HostTier:
    """Kept caches by (owner, tokens), LRU by bytes under ``max_bytes``.

    ``owner`` is whatever keys a keeper's lookups apart: namespace, model
    digest and (a strict store's) backend kind, for ``persist serve`` and a
    Store alike (``host_store.owner``): one tier shared by tenants never
    serves one's cache to another.
    Thread-safe: a server's generation thread keeps and fetches, /metrics
    reads; a Store's savers and lookups may run in several threads.
    """

    def __init__(self, max_bytes: int) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgumentError(f"the host cache's size is bytes, at least 0: {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], _Kept] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.hits = self.misses = self.kept = self.evicted = 0
        self.clock = time.perf_counter  # tests inject one: no timing verdicts

    def __len__(self) -> int:
        return len(self._entries)

    def keep(
        self,
        owner: str,
        tokens: Sequence[int],
        cache: Sequence[Any] | Snapshot,
        *,
        copy: bool = False,
        trimmable: bool | None = None,
        min_resume: int | None = None,
        sticky: bool = False,
        info: Any = None,
    ) -> bool:
        """Keep ``cache`` (covering exactly ``tokens``); False if it cannot fit.

        ``copy=False``: the caller gives the cache up (an eviction) and it is
        kept as it is, counted by its buffers' bytes.  ``copy=True``: the
        caller goes on using it; a copy of its live positions is kept.
        ``trimmable`` and ``min_resume`` default to the codecs' facts.  Older
        entries of ``owner`` the new one covers (``policy.covers``) are
        dropped, unless ``sticky`` (checkpoints, as the durable store keeps)."""
        if not tokens:
            return False
        if cache.unverified if isinstance(cache, Snapshot) else carries_unverified(cache):
            return False  # continues unverified tokens (persist.marks): serves no lookup
        if isinstance(cache, Snapshot):
            records, facts = list(cache.records), cache.facts
        else:
            records = [encode_cache(c) for c in cache]  # after: facts may depend on it
            facts = [facts_of(c) for c in cache]
        if trimmable is None:
            trimmable = policy.combine_trimmable(f.trimmable for f in facts)
        if min_resume is None:
            min_resume = policy.combine_floor(f.min_resume_offset for f in facts)
        if copy:
            records = [_copied(r) for r in records]
        mx.eval(_arrays(records))
        n = int(sum(a.nbytes for a in _arrays(records)))  # a copy holds its live positions
        if not copy and not isinstance(cache, Snapshot):  # views: whole buffers stay alive
            n = int(sum(getattr(c, "nbytes", 0) for c in cache)) or n
        if n > self.max_bytes:
            return False
        key = (owner, tuple(int(t) for t in tokens))
        toks = np.asarray(key[1], dtype=np.int64)
        with self._lock:
            i = next(self._ids)
            kept = _Kept(i, records, n, toks, trimmable, min_resume, sticky, info, used=i)
            self._drop_covered(owner, kept)
            self._entries[key] = kept
            self.nbytes += n
            self.kept += 1
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes
                self.evicted += 1
        return True

    def _drop_covered(self, owner: str, new: _Kept) -> None:
        """Under the lock: what ``new`` stands in for goes (the same tokens at least)."""
        for key, old in list(self._entries.items()):
            if key[0] != owner or (old.sticky and len(old.tokens) != len(new.tokens)):
                continue
            is_prefix = _common(old.tokens, new.tokens) == len(old.tokens)
            n, trim, floor = len(new.tokens), new.trimmable, new.min_resume
            if policy.covers(n, trim, floor, len(old.tokens), is_prefix):
                del self._entries[key]
                self.nbytes -= old.nbytes

    def _choose(self, owner: str, toks: Any) -> tuple[tuple[str, tuple[int, ...]], int] | None:
        """Under the lock: (key, usable prefix) the resume policy picks, or None."""
        keys, cands = {}, []
        for key, kept in self._entries.items():
            if key[0] == owner:
                keys[kept.id] = key
                c = policy.Candidate(
                    kept.id, len(kept.tokens), kept.trimmable, kept.min_resume, kept.used
                )
                cands.append((c, _common(kept.tokens, toks)))
        picked = policy.choose(cands, len(toks))
        return None if picked is None else (keys[picked.candidate.id], picked.prefix)

    def peek(self, owner: str, tokens: Sequence[int]) -> tuple[int, int]:
        """(tokens, about the bytes) a fetch would serve now, (0, 0) if none; copies
        nothing.  A cut copies its share of the positions."""
        toks = np.asarray([int(t) for t in tokens], dtype=np.int64)
        with self._lock:
            found = self._choose(owner, toks)
            if found is None:
                return 0, 0
            key, use = found
            kept = self._entries[key]
            return use, kept.nbytes * use // len(kept.tokens)

    def missed(self) -> None:
        """Count a lookup this tier could not answer (a keeper that asked ``peek``)."""
        with self._lock:
            self.misses += 1

    def fetch(self, owner: str, tokens: Sequence[int], longer_than: int = 0) -> HostHit | None:
        """The best usable kept prefix of ``tokens`` if longer than ``longer_than``, as
        a fresh copy cut to it; its entry becomes most recent.

        Usable: a kept cache whose tokens begin ``tokens``, or, if it can be
        trimmed, the part it shares with them (a conversation's next turn
        differs where the client's text of the last answer begins)."""
        toks = np.asarray([int(t) for t in tokens], dtype=np.int64)
        with self._lock:
            found = self._choose(owner, toks)
            if found is None or found[1] <= longer_than:
                self.misses += 1
                return None
            key, use = found
            self._entries.move_to_end(key)
            kept = self._entries[key]
            kept.used = next(self._ids)
            self.hits += 1
            t0 = self.clock()
            records = kept.records
            if use < len(kept.tokens):
                records = [trim_record(r, use) for r in records]
            # under the lock: an eviction cannot free the entry mid-copy
            cache = rebuild([_handed_out(r) for r in records])  # evaluated: nothing lazy
            seconds = self.clock() - t0
        nbytes = int(sum(a.nbytes for a in _arrays(records)))  # what was copied
        return HostHit(cache, [int(t) for t in toks[:use]], nbytes, seconds, kept.info)

    def clear(self) -> None:
        """Drop every entry (a Store's ``close``)."""
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

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
