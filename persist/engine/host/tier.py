"""A host-RAM tier: caches kept in RAM, by (owner, tokens), asked before the store.

Two keepers use it.  ``persist serve`` keeps what mlx-lm's ``LRUPromptCache``
evicts (``--prompt-cache-size`` or its byte limit reached): asking the
durable store for it again costs a file read and a checksum pass.
``persist.Store(root, host_cache=N)`` keeps a copy of every save that may
serve lookups (``engine.host.store_hooks``).  Up to a byte budget, evicted in
the store's order (``engine.host.eviction``: least recently used first unless
retention hints say otherwise), by tenants' shares with ``--tenant-max-bytes``
(``engine.host.shares``).

Entries are kept as codec records (``persist.codecs``) and served by the
resume policy the durable index uses (``policy.best_candidate``: the longest usable
prefix, at least one token left over, never below a snapshot's floor, an
untrimmable one only at its own length, then an exact length, then the most
recent), cut by the codecs' ``trim_record`` as a durable partial hit is.
Every hit is rebuilt from a copy in buffers of its own (``engine.host.records``):
nothing handed out shares memory with what is kept.

On the CPU (and Metal's unified memory) the kept cache is host memory
already, kept as it is.  On CUDA (the process's data path ``cuda-pinned``,
``cuda.pinned.data_path``) a tier keeps no device array: a ``Holder``
(``cuda.pinned_pool``) packs every entry into pages of pinned host memory
with a kernel and unpacks a hit over PCIe into fresh device arrays (kernel
outputs: device memory, never managed memory), and eviction frees the pages.
The tier's byte count is then the pages' bytes and stays the authority: it
evicts down to its budget before it asks the pool for pages.  CUDA without
pinned memory keeps device arrays (``engine.host.placement``: "device memory").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ... import policy, servable
from ...codecs import encode_cache, facts_of, trim_record
from ...codecs.snapshot import Snapshot, rebuild, require_covers
from ...cuda import pinned
from ...cuda.pinned_pool import Held, Holder
from ...errors import HostCacheFullError, InvalidArgumentError
from ...marks import carries_unverified
from ...records import Record
from .eviction import Kept, Key, victims
from .placement import pinned_holder, placement
from .records import arrays_of, copied, emptied, filled, handed_out
from .shares import Shares

log = logging.getLogger("persist")

__all__ = ["HostTier", "HostHit", "HOST"]

HOST = "host"  # the tier name in rates, metrics, lookups and Restored.source


@dataclass(frozen=True)
class HostHit:
    cache: list[Any]  # rebuilt from a copy, evaluated: the caller owns it
    tokens: list[int]  # the prefix of the asked tokens it covers
    nbytes: int  # bytes copied
    seconds: float  # the copy, as timed by the tier's clock
    info: Any = None  # what the keeper attached (the Store: the save's EntryInfo)


def _common(kept: Any, toks: Any) -> int:
    n = min(len(kept), len(toks))
    differ = np.flatnonzero(kept[:n] != toks[:n])
    return int(differ[0]) if differ.size else n


class HostTier:
    """Kept caches by (owner, tokens), under ``max_bytes``: LRU, unless retention hints
    order them (``engine.host.eviction``: the store's ``policy.eviction_key``).

    ``owner`` is whatever keys a keeper's lookups apart: namespace, model
    digest and (a strict store's) backend kind, for ``persist serve`` and a
    Store alike (``host_store.owner``): one tier shared by tenants never
    serves one's cache to another.
    Thread-safe: a server's generation thread keeps and fetches, /metrics
    reads; a Store's savers and lookups may run in several threads.
    ``holder``: where entries' arrays are kept (tests inject host pages); None:
    pinned pages on CUDA (``cuda-pinned``), the arrays as they are elsewhere.
    """

    def __init__(self, max_bytes: int, holder: Holder | None = None) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgumentError(f"the host cache's size is bytes, at least 0: {max_bytes!r}")
        self.max_bytes, self.holder = max_bytes, holder
        why = None
        if holder is None and max_bytes and pinned.data_path().path == pinned.CUDA_PINNED:
            self.holder, why = pinned_holder(max_bytes)
        self.where = self.holder.where if self.holder is not None else placement()
        if why is not None:
            # never a wrong cache, and never device memory mlx-lm's eviction meant to
            # free: a tier whose pages failed their check keeps nothing
            log.warning("persist: pinned host pages: %s; the host tier is off", why)
            self.max_bytes, self.where = 0, f"off (pinned pages: {why})"
        self.nbytes = 0
        # a tenant's share (engine.host.shares); None: one LRU for all (persist serve
        # --tenant-max-bytes: one tenant cannot evict everyone)
        self.owner_max_bytes: int | None = None
        self._shares = Shares()
        self._entries: OrderedDict[Key, Kept] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.hits = self.misses = self.kept = self.evicted = 0
        self.clock = time.perf_counter  # tests inject one: no timing verdicts
        self.now = time.time  # what a ttl counts in (tests inject one)

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
        hints: tuple[float, int] | None = None,
    ) -> bool:
        """Keep ``cache`` (covering exactly ``tokens``); False if it cannot fit.

        ``copy=False``: the caller gives the cache up (an eviction) and it is
        kept as it is, counted by its buffers' bytes.  ``copy=True``: the
        caller goes on using it; a copy of its live positions is kept.
        ``trimmable`` and ``min_resume`` default to the codecs' facts.  Older
        entries of ``owner`` the new one covers (``policy.covers``) are
        dropped, unless ``sticky`` (checkpoints, as the durable store keeps), and the
        new one keeps their retention hints.  ``hints`` (ttl seconds, priority) order
        eviction as the store's do (``engine.host.eviction``); the budgets still hold."""
        if not tokens:
            return False
        if cache.unverified if isinstance(cache, Snapshot) else carries_unverified(cache):
            return False  # continues unverified tokens (persist.marks): serves no lookup
        if isinstance(cache, Snapshot):
            records, facts = list(cache.records), cache.facts
        else:
            require_covers(cache, tokens)  # kept under other tokens, it would serve them
            records = [encode_cache(c) for c in cache]  # after: facts may depend on it
            facts = [facts_of(c) for c in cache]
        if trimmable is None:
            trimmable = policy.combine_trimmable(f.trimmable for f in facts)
        if min_resume is None:
            min_resume = policy.combine_floor(f.min_resume_offset for f in facts)
        # narrowed by the rules over the records themselves (persist.servable), as a
        # durable row is: a row's facts may predate a rule
        ruled = [s for r in records if (s := servable.of_record(r)) is not None]
        rule = servable.intersect([servable.Servable(trimmable, min_resume), *ruled])
        trimmable, min_resume = rule.trimmable, rule.floor
        if copy and self.holder is None:  # pages are a copy already
            records = [copied(r) for r in records]
        arrays = arrays_of(records)
        mx.eval(arrays)
        n = self._size(arrays, cache, copy)
        if n > min(self.max_bytes, self.owner_max_bytes or self.max_bytes):
            return False
        key = (owner, tuple(int(t) for t in tokens))
        toks = np.asarray(key[1], dtype=np.int64)
        with self._lock:
            if n > self.max_bytes:  # closed meanwhile
                return False
            i = next(self._ids)
            kept = Kept(
                id=i,
                records=records,
                nbytes=n,
                tokens=toks,
                trimmable=trimmable,
                min_resume=min_resume,
                sticky=sticky,
                info=info,
                used=i,
            )
            kept.touched = self.now()
            kept.hint(hints)
            self._drop_covered(owner, kept)
            if key in self._entries:  # never two entries' bytes under one key
                kept.hint(self._hints_of(key))
                self._remove(key)
            if not self._make_room(owner, n, self.max_bytes):
                return False
            if self.holder is not None:
                kept.held = self._hold(arrays, owner, n)
                if kept.held is None:
                    return False
                kept.records = [emptied(r) for r in records]
            self._entries[key] = kept
            self.nbytes += n
            self._shares.add(owner, n)
            self.kept += 1
        return True

    def _size(self, arrays: list[Any], cache: Any, copy: bool) -> int:
        """The bytes an entry holds: its pages with a holder, else its arrays' bytes
        (a copy holds its live positions; a cache given up, its whole buffers)."""
        if self.holder is not None:
            return self.holder.footprint([int(a.nbytes) for a in arrays])
        n = int(sum(a.nbytes for a in arrays))
        if not copy and not isinstance(cache, Snapshot):  # views: whole buffers stay alive
            n = int(sum(getattr(c, "nbytes", 0) for c in cache)) or n
        return n

    def _make_room(self, owner: str, n: int, limit: int) -> bool:
        """Under the lock: evict (``engine.host.shares``) until ``owner`` may keep ``n``
        more bytes within its share and the tier holds at most ``limit`` with them."""
        while True:
            over = self.nbytes + n > limit
            order = victims(self._entries, self.now())  # hints first, then least recent
            key = self._shares.victim(order, owner, n, over, self.owner_max_bytes)
            if key is None:
                share = self.owner_max_bytes
                return not over and (share is None or self._shares.fits(owner, n, share))
            self._remove(key)
            self.evicted += 1

    def _hold(self, arrays: list[Any], owner: str, n: int) -> Held | None:
        """Under the lock, room made: ``arrays`` in the holder's pages, evicting one more
        entry at a time while the pool is full (pinned memory refused); None when
        nothing is left to evict."""
        assert self.holder is not None
        while True:
            try:
                return self.holder.hold(arrays)
            except HostCacheFullError:
                # pinning more was refused: evicting helps only if what is pinned
                # already could hold the entry (else it would empty the tier for nothing)
                if not self._entries or n > self.holder.pinned_bytes():
                    return None
                if not self._make_room(owner, n, self.nbytes + n - 1):  # one more goes
                    return None

    def _remove(self, key: Key) -> None:
        """Under the lock: drop an entry, its pages back to the pool."""
        kept = self._entries.pop(key)
        self.nbytes -= kept.nbytes
        self._shares.remove(key[0], kept.nbytes)
        if kept.held is not None and self.holder is not None:
            self.holder.release(kept.held)

    def _evict_oldest(self) -> None:
        """Under the lock: the first entry in eviction order goes (what ``_make_room``
        takes first when no tenant share decides)."""
        self._remove(next(iter(victims(self._entries, self.now()))))
        self.evicted += 1

    def _hints_of(self, key: Key) -> tuple[float, int]:
        kept = self._entries[key]
        return kept.ttl, kept.priority

    def _drop_covered(self, owner: str, new: Kept) -> None:
        """Under the lock: what ``new`` stands in for goes (the same tokens at least)."""
        for key, old in list(self._entries.items()):
            if key[0] != owner or (old.sticky and len(old.tokens) != len(new.tokens)):
                continue
            is_prefix = _common(old.tokens, new.tokens) == len(old.tokens)
            n, trim, floor = len(new.tokens), new.trimmable, new.min_resume
            if policy.covers(n, trim, floor, len(old.tokens), is_prefix):
                new.hint(self._hints_of(key))  # it serves old's prefix now: its hints too
                self._remove(key)

    def _choose(self, owner: str, toks: Any) -> tuple[Key, int] | None:
        """Under the lock: (key, usable prefix) the resume policy picks, or None."""
        keys, cands = {}, []
        for key, kept in self._entries.items():
            if key[0] == owner:
                keys[kept.id] = key
                c = policy.Candidate(
                    kept.id, len(kept.tokens), kept.trimmable, kept.min_resume, kept.used
                )
                cands.append((c, _common(kept.tokens, toks)))
        picked = policy.best_candidate(cands, len(toks))
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
            kept.used, kept.touched = next(self._ids), self.now()
            self.hits += 1
            t0 = self.clock()
            records, fresh = self._given(kept)
            if use < len(kept.tokens):
                records = [trim_record(r, use) for r in records]
            # under the lock: an eviction cannot free the entry mid-copy
            cache = rebuild([handed_out(r, fresh) for r in records])  # evaluated: nothing lazy
            seconds = self.clock() - t0
        nbytes = int(sum(a.nbytes for a in arrays_of(records)))  # what was copied
        return HostHit(cache, [int(t) for t in toks[:use]], nbytes, seconds, kept.info)

    def _given(self, kept: Kept) -> tuple[list[Record], frozenset[int]]:
        """Under the lock: the entry's records, their arrays unpacked from its pages
        if it has any (and those arrays' ids: nothing else holds them)."""
        if kept.held is None or self.holder is None:
            return kept.records, frozenset()
        arrays = self.holder.give(kept.held)
        it = iter(arrays)
        return [filled(r, it) for r in kept.records], frozenset(id(a) for a in arrays)

    def reserve(self) -> int:
        """Pin the holder's whole budget now (``PagePool.reserve``); bytes pinned, 0
        without a holder (the tier keeps arrays as they are: nothing to pin)."""
        return self.holder.reserve() if self.holder is not None else 0

    def clear(self, close: bool = False) -> None:
        """Drop every entry; pinned pages go back to the system.  ``close`` (a Store's
        close): keep nothing after, so a save that commits beside the close pins none."""
        with self._lock:
            for key in list(self._entries):
                self._remove(key)
            if close:
                self.max_bytes = 0
            if self.holder is not None:
                self.holder.trim()

    def stats(self) -> dict[str, Any]:
        """Counts and bytes, and where the entries are kept (``where``; with a holder,
        ``pinned_bytes``: the memory its pool holds, in use or not)."""
        with self._lock:
            pool = {"pinned_bytes": self.holder.pinned_bytes()} if self.holder else {}
            return {
                "where": self.where,
                **pool,
                "bytes": self.nbytes,
                "budget_bytes": self.max_bytes,
                "entries": len(self._entries),
                "hits": self.hits,
                "misses": self.misses,
                "kept": self.kept,
                "evicted": self.evicted,
            }
