"""A prompt's deepest snapshot on a tier, pulled on a miss when it beats what this
machine holds and a prefill (``Shared.pull_prefix``, ``lookup_order``).

Two round trips find it: one MGET of the prompt's chain pointers and head keys,
one pipelined GET of at most two records (``_deepest``); the cost model decides
whether pulling and restoring it beats a prefill of its tokens (``_worth``).  A
damaged, evicted or unfitting snapshot is a miss, never an error nor a wrong cache.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ...errors import CorruptBlobError, StoreFullError
from ...storage.blobs import BlobStore
from ...storage.chains import boundary_heads, chain_root, chains
from ...storage.index import Index
from ..costs import LOCAL, CostModel
from ..layer_checks import quantized_start
from ..skips import skipped_damaged
from .pull import EvictedError, pull
from .records import BadValue, Expect, Keys, best_record, open_record

__all__ = ["PrefixPulls"]

log = logging.getLogger("persist")


class PrefixPulls:
    """``Shared``'s prefix pulls (engine/tiers/exchange.py holds the rest of it)."""

    tier: Any
    keys: Keys
    name: str

    if TYPE_CHECKING:  # ``Shared``'s

        def secret(self, index: Index, namespace: str, create: bool = False) -> bytes | None: ...

        def _run(self, op: Any) -> Any: ...

        def _count(self, index: Index, namespace: str, what: str) -> None: ...

        def _bad(self, index: Index, namespace: str, e: BadValue) -> None: ...

        def _bytes(self, index: Index, namespace: str, before: dict[str, int]) -> None: ...

    def pull_prefix(
        self,
        index: Index,
        blobs: BlobStore,
        toks: list[int],
        *,
        identity: Any,
        namespace: str,
        block: int,
        costs: CostModel | None = None,
        max_cost: float | None = None,
        longer_than: int = 0,
        held: int | None = None,
    ) -> None:
        """Pull the tier's deepest snapshot of this prompt if it beats the local one
        and ``longer_than`` (what the host tier holds), and, with ``costs``, if
        pulling and restoring it beats a prefill of its tokens past ``held`` (what
        the caller holds in memory; None: ``longer_than``)."""
        from ..reading import index_hit

        secret = self.secret(index, namespace)  # adopts the fleet's secret on a new machine
        if secret is None:
            return
        local = index_hit(
            index, toks, identity, namespace=namespace, block_tokens=block, skip=set()
        )
        every = chains(chain_root(secret, identity.digest), toks, block)
        heads = boundary_heads(every, toks, block)  # prefixes that end inside a block
        want = Expect(namespace, secret=secret, block=block, identity=identity.digest)
        bodies = self._run(lambda: self._deepest(index, namespace, every[1:], heads, want)) or []
        found = best_record(bodies, toks, quantized_start(identity))
        if found is None or found[0] <= max(local[1] if local else 0, longer_than):
            self._count(index, namespace, "misses")
            return
        usable, body = found
        worth = self._worth(
            costs, identity, namespace=namespace, body=body, usable=usable, max_cost=max_cost,
            held=longer_than if held is None else held,
        )  # fmt: skip
        if not worth:
            return
        before = dict(self.tier.counters)
        try:
            t0 = time.perf_counter()
            pulled = self._run(
                lambda: pull(
                    index,
                    blobs,
                    self.tier,
                    keys=self.keys,
                    namespace=namespace,
                    body=body,
                    named=False,
                )
            )
            if pulled:
                self._count(index, namespace, "hits")
                moved = self.tier.counters.get("bytes_pulled", 0) - before.get("bytes_pulled", 0)
                if costs is not None:
                    costs.restored(identity, self.name, moved, time.perf_counter() - t0)
        except EvictedError:  # a shorter hit or none, never an error
            self._count(index, namespace, "incomplete")
        except BadValue as e:
            self._bad(index, namespace, e)
        except CorruptBlobError as e:  # never a wrong cache: the local answer stands
            self._count(index, namespace, "corrupt_skipped")
            skipped_damaged()
            log.warning("persist: skipping a damaged shared snapshot: %s", e)
        except StoreFullError as e:  # the disk has no room for it: the local answer stands
            self._count(index, namespace, "full_skipped")
            log.warning("persist: shared snapshot not pulled: %s", e)
        self._bytes(index, namespace, before)

    def _deepest(
        self, index: Index, namespace: str, chs: list[bytes], heads: list[bytes], want: Expect
    ) -> list[dict[str, Any]]:
        """Checked records of the deepest snapshots of the prompt the tier knows, in two
        round trips: one MGET of every pointer, one pipelined GET of at most two records.
        The candidates: the end of the longest run of the prompt's chains from the start
        (an LRU may drop a parent and keep its child: only the consecutive run counts),
        and the deepest head key (``heads[b]``: the prompt's 16 tokens after block
        boundary b, under chain b) at a boundary at least that deep."""
        items = [("blk", c) for c in chs] + [("head", h) for h in heads]
        found = self.tier.pointers(namespace, items) if items else []
        blk, hd = found[: len(chs)], found[len(chs) :]
        depth = 0
        while depth < len(blk) and blk[depth] is not None:
            depth += 1
        at = max((b for b, v in enumerate(hd) if v is not None), default=-1)
        followed = [("head", heads[at], hd[at])] if at >= depth else []
        if depth:
            followed.append(("blk", chs[depth - 1], blk[depth - 1]))
        rkeys: list[tuple[str, tuple[str, bytes]]] = []
        for kind, key, value in followed:
            try:
                rkeys.append((self.keys.open_pointer(namespace, kind, key, value), (kind, key)))
            except BadValue as e:
                self._bad(index, namespace, e)
        out = []
        values = self.tier.records(namespace, [r for r, _ in rkeys])
        for (rkey, via), value in zip(rkeys, values, strict=True):
            if value is None:
                continue
            try:
                want.rkey, want.via = rkey, via
                out.append(open_record(self.keys, value, want))
            except BadValue as e:
                self._bad(index, namespace, e)
        return out

    def _worth(
        self,
        costs: CostModel | None,
        identity: Any,
        *,
        namespace: str,
        body: dict[str, Any],
        usable: int,
        max_cost: float | None,
        held: int = 0,
    ) -> bool:
        """Is pulling this record's blobs, then restoring ``usable`` tokens of them,
        predicted to beat a prefill of those past ``held``?"""
        if costs is None:
            return True
        nbytes = sum(int(v[0]) for v in body["blobs"].values())
        via = [(self.name, nbytes), (LOCAL, nbytes)]
        if costs.decide(identity, namespace, via, usable, max_cost, held).restore:
            return True
        self._count(costs.index, namespace, "declined")
        return False
