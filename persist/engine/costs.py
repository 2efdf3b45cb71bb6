"""Restore or recompute: measured rates in, a decision out (``policy.decide_cost``).

Restores are timed where they happen (``reading``: the local store; ``tiers``:
a pull from Redis or S3; ``host_store.served``: a copy out of the host tier)
and prefills where they happen (``persist.prefill``, ``persist generate``,
``persist serve``); the rates live in the index
(``persist.storage.rates``), per machine, so every process on this machine
learns from the others.  No measurement yet: restore, as persist always did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING

import msgpack

from .. import policy
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from ..storage import rates
from ..storage.full import best_effort

if TYPE_CHECKING:
    from ..storage.blobs import BlobStore
    from ..storage.index import Index, SnapshotRow

__all__ = ["CostModel", "LOCAL", "LOCAL_DISK", "local_hit"]

LOCAL = "local"  # the tier name of this store's own files (in the page cache)
LOCAL_DISK = "local-disk"  # the same, when the disk must read them first
SAMPLE = 8  # blob files probed per hit (the tail and up to 7 blocks)
WARM = 0.9  # share of a hit's sampled pages in the page cache that makes it LOCAL
MIN_PREFILL = 16  # tokens: shorter forwards are decode steps, not a prefill rate


def _blocks_read(row: SnapshotRow, prefix: int) -> int | None:
    """Blocks a hit of ``prefix`` tokens reads (None: all of the row's files)."""
    try:
        body = msgpack.unpackb(row.manifest, raw=False)
        split, block = bool(body.get("split")), int(body.get("block", 1))
    except Exception:  # a damaged row: the read that follows refuses it, typed
        return None
    return policy.partial_blocks(prefix, row.n_tokens, row.n_blocks, block, split)


def local_hit(
    index: Index, blobs: BlobStore, row: SnapshotRow, prefix: int | None
) -> tuple[str, int]:
    """(rate, bytes) of reading ``prefix`` tokens of ``row`` (None: all of it) from
    this store's files: the blocks covering them and the tail (the partial-read
    rule of ``loading.load_snapshot``), priced at the page cache's rate or the
    disk's (``_tier``)."""
    need = None if prefix is None else _blocks_read(row, prefix)
    if need is None:
        nbytes = row.nbytes
    else:
        head = index.blob_head(row.tail)
        tail = head[0] if head is not None else 0
        nbytes = tail + (row.nbytes - tail) * need // row.n_blocks
    return _tier(index, blobs, row, need), nbytes


def _tier(index: Index, blobs: BlobStore, row: SnapshotRow, need: int | None) -> str:
    """LOCAL when a hit's blob files are in the page cache, LOCAL_DISK when the disk
    must read them: a sample of SAMPLE files spread over the ``need`` blocks read
    (None: all), the first and the last among them, WARM of their pages resident or
    more.  The two rates differ several times (an H200: 0.13 s against 0.64 s for
    1 GiB), and one rate for both predicted neither.  A store that cannot tell
    keeps one rate, LOCAL."""
    cached = getattr(blobs, "cached", None)
    if cached is None:
        return LOCAL
    n = row.n_blocks if need is None else need
    picks = sorted({round(i * (n - 1) / (SAMPLE - 2)) for i in range(SAMPLE - 1)}) if n else []
    files = [row.tail, *index.block_blobs(row.id, picks)]
    shares = [s for s in (cached(f) for f in files) if s is not None]
    if not shares:
        return LOCAL
    return LOCAL if sum(shares) / len(shares) >= WARM else LOCAL_DISK


class CostModel:
    """A store's rates and decisions; ``last`` is the latest decision of this process."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.last: policy.CostDecision | None = None
        self.clock: Callable[[], float] = time.perf_counter  # tests inject one: no timing verdicts

    def begin(self, max_cost: float | None) -> None:
        """A lookup starts: ``max_cost`` must be seconds (>= 0; ``math.inf``: always)."""
        if max_cost is not None and not max_cost >= 0:
            raise InvalidArgumentError(f"max_cost is seconds, at least 0: not {max_cost!r}")
        self.last = None

    def _machine(self, identity: ModelIdentity) -> str:
        return rates.machine_name(identity.backend)

    def restore_seconds(self, identity: ModelIdentity, tier: str, nbytes: int) -> float | None:
        got = rates.rates(self.index, self._machine(identity), "restore", tier)
        return policy.restore_seconds(got, nbytes)

    def prefill_seconds(self, identity: ModelIdentity, start: int, end: int) -> float | None:
        got = rates.rates(self.index, self._machine(identity), "prefill", identity.digest)
        return policy.prefill_seconds(got, start, end)

    def decide(
        self,
        identity: ModelIdentity,
        namespace: str,
        tiers: list[tuple[str, int]],
        tokens: int,
        max_cost: float | None,
    ) -> policy.CostDecision:
        """Restore ``tokens`` tokens through ``tiers`` ((tier, bytes) read from each)?"""
        parts = [self.restore_seconds(identity, t, n) for t, n in tiers]
        restore = None if any(p is None for p in parts) else sum(p for p in parts if p)
        prefill = self.prefill_seconds(identity, 0, tokens)
        d = policy.decide_cost(tokens, tiers[0][1], tiers[0][0], restore, prefill, max_cost)
        self.last = d
        rates.note_decision(self.index, namespace, asdict(d))
        which = "cost_restored" if d.restore else "cost_recomputed"
        best_effort(self.index.count, namespace, **{which: 1})
        return d

    def restored(self, identity: ModelIdentity, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            here, bucket = self._machine(identity), policy.rate_bucket(nbytes)
            rates.record(self.index, here, "restore", tier, bucket, nbytes / seconds)

    def prefilled(self, identity: ModelIdentity, start: int, end: int, seconds: float) -> None:
        """A measured prefill of positions [start, end) (the forward and its evaluation)."""
        if end - start >= MIN_PREFILL and seconds > 0:
            here, bucket = self._machine(identity), policy.rate_bucket((start + end) // 2)
            rate = (end - start) / seconds
            rates.record(self.index, here, "prefill", identity.digest, bucket, rate)

    @contextmanager
    def timing_restore(self, identity: ModelIdentity, tier: str, nbytes: int) -> Iterator[None]:
        """Time the block as a restore of ``nbytes`` from ``tier`` (only if it completes)."""
        t0 = self.clock()
        yield
        self.restored(identity, tier, nbytes, self.clock() - t0)
