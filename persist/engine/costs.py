"""Restore or recompute: measured rates in, a decision out (``policy.recompute.decide_cost``).

Restores are timed where they happen (``reading``: the local store; ``tiers``:
a pull from Redis or S3; ``host_store.served``: a copy out of the host tier)
and prefills where they happen (``persist.prefill``, ``persist generate``,
``persist serve``); the rates live in the index
(``persist.storage.rates``), per machine, so every process on this machine
learns from the others.  No measurement yet: restore, as persist always did.

The model keeps learning (issue 39): an estimate is the median of a bucket's
latest samples with its optimistic end and sample count (``policy.recompute.rate_of``);
the first restore from a tier and the first prefill of a model in a process
carry one-time costs (kernels compiled, pinned memory allocated, pages
faulted in) and are kept apart as ``<what>-first``, never as a rate (they
price only a process's own first run, against its first prefill); a hit
declined as slower is restored anyway now and then (``EXPLORE_EVERY``
declines of its bucket in this process, or its bucket unmeasured for
``EXPLORE_AFTER`` seconds) so a wrong estimate is measured again; a tier not
measured yet (or learning) is bounded by the fastest tier measured confidently
(``policy.recompute.floor_seconds``): a hit that loses even at that rate is declined.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import msgpack

from .. import policy
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from ..policy import recompute
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
FIRST = "-first"  # appended to what a process's first run of a kind is kept as
EXPLORE_EVERY = 8  # at most one in this many declined hits of a bucket is restored anyway
EXPLORE_AFTER = 600.0  # seconds: a bucket not measured for this long is measured again


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
        self.last: recompute.CostDecision | None = None
        self.clock: Callable[[], float] = time.perf_counter  # tests inject one: no timing verdicts
        self.wall: Callable[[], float] = time.time  # when samples are taken: their age
        self.max_cost: float | None = None  # a lookup's limit when it names none (--max-cost)
        self._warm: set[tuple[str, str]] = set()  # (what, key) measured once in this process
        self._declined: dict[tuple[str, int], int] = {}  # (tier, bucket) -> declines since

    def begin(self, max_cost: float | None) -> float | None:
        """A lookup starts: its limit (``max_cost``, else ``self.max_cost``) must be
        seconds (>= 0; ``math.inf``: always); returned."""
        limit = self.max_cost if max_cost is None else max_cost
        if limit is not None and not limit >= 0:
            raise InvalidArgumentError(f"max_cost is seconds, at least 0: not {limit!r}")
        self.last = None
        return limit

    def _machine(self, identity: ModelIdentity) -> str:
        return rates.machine_name(identity.backend)

    def _samples(self, identity: ModelIdentity, what: str, key: str) -> dict[int, rates.Samples]:
        """The samples that price this process's next run of ``what``: its first runs'
        while it has made none (a fresh process pays the one-time costs too), else
        (or when none were kept) the rates'."""
        here = self._machine(identity)
        if (what, key) not in self._warm:
            first = rates.samples(self.index, here, what + FIRST, key)
            if first:
                return first
        return rates.samples(self.index, here, what, key)

    def restore_estimate(
        self, identity: ModelIdentity, tier: str, nbytes: int
    ) -> recompute.RestoreEstimate | None:
        got = self._samples(identity, "restore", tier)
        return recompute.restore_estimate({b: s.values for b, s in got.items()}, nbytes)

    def restore_seconds(self, identity: ModelIdentity, tier: str, nbytes: int) -> float | None:
        est = self.restore_estimate(identity, tier, nbytes)
        return None if est is None else est.seconds

    def prefill_seconds(self, identity: ModelIdentity, start: int, end: int) -> float | None:
        got = self._samples(identity, "prefill", identity.digest)
        typical = {b: est.typical for b, s in got.items() if (est := recompute.rate_of(s.values))}
        return recompute.prefill_seconds(typical, start, end)

    def predict(
        self,
        identity: ModelIdentity,
        tiers: list[tuple[str, int]],
        tokens: int,
        max_cost: float | None,
        held: int = 0,
    ) -> recompute.CostDecision:
        """The decision on ``tokens`` tokens through ``tiers``, recorded nowhere, no
        exploring; ``held``: tokens the caller holds already (its prefill starts there)."""
        parts = [self.restore_estimate(identity, t, n) for t, n in tiers]
        prefill = self.prefill_seconds(identity, min(held, tokens), tokens)
        tier, nbytes = tiers[0]
        known = [p for p in parts if p is not None]
        unsure = len(known) < len(parts) or min(p.samples for p in known) < recompute.MIN_SAMPLES
        floor = self._floor(identity, tiers) if unsure and prefill is not None else None
        if len(known) < len(parts):
            return recompute.decide_cost(
                tokens, nbytes, tier, restore_s=None, prefill_s=prefill, max_cost=max_cost,
                held=held, floor_s=floor,
            )  # fmt: skip
        return recompute.decide_cost(
            tokens,
            nbytes,
            tier,
            restore_s=sum(p.seconds for p in known),
            prefill_s=prefill,
            max_cost=max_cost,
            best_s=sum(p.best for p in known),
            samples=min(p.samples for p in known),
            held=held,
            floor_s=floor,
        )

    def _floor(self, identity: ModelIdentity, tiers: list[tuple[str, int]]) -> float | None:
        """The fewest seconds restoring ``tiers``' bytes could take on this machine
        (``recompute.floor_seconds`` of each part, summed; None where one has none).
        Only buckets measured within EXPLORE_AFTER count: a process that cannot time
        the floor's tier again (no host tier there) would otherwise decline for good."""
        every = rates.samples_by_key(self.index, self._machine(identity), "restore")
        fresh = self.wall() - EXPLORE_AFTER
        measured = {
            t: {b: s.values for b, s in got.items() if s.updated > fresh}
            for t, got in every.items()
        }
        parts = [recompute.floor_seconds(measured, n, t) for t, n in tiers]
        return None if None in parts else sum(p for p in parts if p is not None)

    def decide(
        self,
        identity: ModelIdentity,
        namespace: str,
        tiers: list[tuple[str, int]],
        tokens: int,
        max_cost: float | None,
        held: int = 0,
    ) -> recompute.CostDecision:
        """Restore ``tokens`` tokens through ``tiers`` ((tier, bytes) read from each),
        or prefill those past the ``held`` the caller has?  ``max_cost`` None: the
        model's own (``self.max_cost``, persist's --max-cost)."""
        limit = self.max_cost if max_cost is None else max_cost
        d = self.predict(identity, tiers, tokens, limit, held)
        if d.reason in ("slower", "bound") and self._explore_due(identity, *tiers[0]):
            d = dataclasses.replace(d, restore=True, reason="explore")
        self.last = d
        rates.note_decision(self.index, namespace, dataclasses.asdict(d))
        which = "cost_restored" if d.restore else "cost_recomputed"
        best_effort(self.index.count, namespace, **{which: 1})
        return d

    def _explore_due(self, identity: ModelIdentity, tier: str, nbytes: int) -> bool:
        """Measure a declined hit again? Every EXPLORE_EVERY-th decline of its bucket
        in this process, or when its bucket's newest sample is EXPLORE_AFTER old."""
        key = (tier, recompute.rate_bucket(nbytes))
        n = self._declined.get(key, 0) + 1
        got = self._samples(identity, "restore", tier).get(key[1])
        stale = got is not None and self.wall() - got.updated >= EXPLORE_AFTER
        if n >= EXPLORE_EVERY or stale:
            self._declined[key] = 0
            return True
        self._declined[key] = n
        return False

    def _what(self, what: str, key: str) -> str:
        """``what``, or ``what`` + FIRST for this process's first run of it."""
        if (what, key) in self._warm:
            return what
        self._warm.add((what, key))
        return what + FIRST

    def restored(self, identity: ModelIdentity, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            here, bucket = self._machine(identity), recompute.rate_bucket(nbytes)
            what = self._what("restore", tier)
            rate = nbytes / seconds
            rates.record(self.index, here, what, key=tier, bucket=bucket, rate=rate, at=self.wall())

    def prefilled(self, identity: ModelIdentity, start: int, end: int, seconds: float) -> None:
        """A measured prefill of positions [start, end) (the forward and its evaluation)."""
        if end - start >= MIN_PREFILL and seconds > 0:
            here, bucket = self._machine(identity), recompute.rate_bucket((start + end) // 2)
            rate, what = (end - start) / seconds, self._what("prefill", identity.digest)
            rates.record(
                self.index,
                here,
                what,
                key=identity.digest,
                bucket=bucket,
                rate=rate,
                at=self.wall(),
            )

    @contextmanager
    def timing_restore(self, identity: ModelIdentity, tier: str, nbytes: int) -> Iterator[None]:
        """Time the block as a restore of ``nbytes`` from ``tier`` (only if it completes)."""
        t0 = self.clock()
        yield
        self.restored(identity, tier, nbytes, self.clock() - t0)
