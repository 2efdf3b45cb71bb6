"""The Store's read path: a named session restored, a prompt's longest stored prefix
looked up (``lookup_order.nearest``), what a lookup would find, host-tier warm starts.

``persist.Store`` (engine/store.py) derives from ``StoreReads``; the attributes
below are set in its ``__init__``.  The methods check names and arguments, then
call ``engine.reading`` / ``engine.lookup_order`` / ``engine.warm``, which take the
index and the blob tier, never the Store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ..errors import (
    InvalidArgumentError,
    ReadOnlyStoreError,
    SessionNotFoundError,
    SessionUnreachableError,
    SessionUnreadableError,
)
from ..format.tokens import check_tokens, unpack_tokens
from ..identity import ModelIdentity
from ..records import Progress
from ..storage.check_damage import pop_notice
from ..storage.index import SnapshotRow
from ..storage.rows import check_name, listed_info
from ..storage.types import EntryInfo, Restored
from .costs import CostModel
from .lifecycle import StoreUpkeep

if TYPE_CHECKING:  # loaded by the first restore or warm start, not by ``ls``
    from .host.tier import HostTier
    from .warm import WarmReport

__all__ = ["StoreReads"]

T = TypeVar("T")

log = logging.getLogger("persist")
PULL_READS = 3  # a pulled session evicted before its read is pulled again, twice at most


class StoreReads(StoreUpkeep):
    """Restores, lookups and warm starts of a store; ``persist.Store`` adds saving,
    listing and files."""

    costs: CostModel
    strict_backend: bool

    def restore(
        self,
        session: str,
        *,
        identity: ModelIdentity,
        namespace: str = "default",
        progress: Progress | None = None,
    ) -> Restored:
        """The named session, as fresh caches, exactly as saved (``reading.restore_named``)."""
        from .reading import restore_named

        check_name(namespace, "namespace")
        check_name(session, "session")
        i, strict = self.index, self.strict_backend
        cache, row = self._pulled(
            session, namespace,
            lambda: restore_named(
                i, self.blobs, namespace, session, identity=identity, progress=progress,
                strict_backend=strict, costs=self.costs,
            ),
        )  # fmt: skip
        notice = pop_notice(i, namespace, session)
        if notice is not None:  # said once, here and to whoever logs
            log.warning("persist: %s", notice)
        return Restored(cache, unpack_tokens(row.tokens), self._info(row), notice)

    def _pulled(self, session: str, namespace: str, read: Callable[[], T]) -> T:
        """``read`` of a named session, pulled first from the tiers when this store lacks
        it.  What a pull just committed may be evicted before it is read (a gc
        in another process): the fleet holds it, so it is pulled again (attack 38b, 15)."""
        for attempt in range(PULL_READS):
            pulled = self._pull_named(session, namespace)
            try:
                return read()
            except SessionNotFoundError:
                if not pulled or attempt == PULL_READS - 1:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _pull_named(self, session: str, namespace: str) -> bool:
        """A session this store lacks, from the tiers (the shared one first, then the
        durable one): whether one was pulled.  When it is still not here, a tier that
        may hold it and could not be asked is SessionUnreachableError, and one that names
        it but whose values this machine cannot read (another operator key, an evicted
        part) SessionUnreadableError: a "not found" then would fork its history."""
        if self.read_only and self.tiers:  # a pull writes (a lease, rows, blobs)
            raise ReadOnlyStoreError(self.root)
        if not self.tiers or self.has_session(session, namespace=namespace):
            return False
        down, unread, pulled = [], [], False
        for tier in self.tiers:
            if not self.has_session(session, namespace=namespace):
                before = tier.unreachable
                pulled |= tier.pull_session(self.index, self.blobs, namespace, session)
                if tier.unreachable > before:
                    down.append(tier)
                elif tier.unread is not None:
                    unread.append(tier.unread)
        # pulled, even if a gc elsewhere evicted it since (the caller reads it or pulls again)
        if pulled or self.has_session(session, namespace=namespace):
            return True
        if down:
            from .tiers.lineage import shown_url

            tiers = [f"{t.name} tier ({shown_url(t.tier.url)})" for t in down]
            raise SessionUnreachableError(session, namespace, tiers)
        if unread:
            raise SessionUnreadableError(session, namespace, unread)
        return False

    def lookup(
        self,
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        namespace: str = "default",
        longer_than: int = 0,
        max_cost: float | None = None,
        host: HostTier | None = None,
    ) -> Restored | None:
        """The longest usable stored prefix of ``tokens`` (at least one token is left over).

        Token-exact: a hit of k tokens holds exactly what a fresh prefill of
        those k tokens would (the codecs cut every layer to k).  A hit of at
        most ``longer_than`` tokens (what a caller already holds in memory)
        is not read at all and returns None, uncounted.  A hit predicted to
        restore slower than prefilling its tokens here (rates measured on
        this machine; ``max_cost`` seconds instead, if given) is declined:
        None.  ``self.costs.last`` is the decision.  With ``host_cache`` the
        RAM copy serves unless the store holds a strictly longer hit
        (``Restored.source`` says which); ``host`` asks that RAM tier instead
        (``persist serve``'s own).  The order is ``engine.lookup_order``'s.
        """
        from .lookup_order import nearest

        toks = check_tokens(tokens)
        check_name(namespace, "namespace")
        self.costs.begin(max_cost)  # checks max_cost; forgets the previous decision
        return nearest(
            self, toks, identity=identity, namespace=namespace, longer_than=longer_than,
            max_cost=max_cost, host=self.host if host is None else host, tiers=self.tiers,
        )  # fmt: skip

    def record_prefill(self, identity: ModelIdentity, start: int, end: int, seconds: float) -> None:
        """Tell the cost model a prefill of positions [start, end) took ``seconds`` here
        (``persist.prefill``, ``persist generate`` and ``persist serve`` do)."""
        self.costs.prefilled(identity, start, end, seconds)

    def find(
        self, tokens: Sequence[int], *, identity: ModelIdentity, namespace: str = "default"
    ) -> tuple[EntryInfo, int] | None:
        """What ``lookup`` would restore (entry, usable prefix), from the index alone."""
        from .reading import index_hit

        toks = check_tokens(tokens)
        check_name(namespace, "namespace")
        found = index_hit(
            self.index,
            toks,
            identity,
            namespace=namespace,
            block_tokens=self.block_tokens,
            skip=set(),
        )
        return None if found is None else (self._info(found[0]), found[1])

    def warm(self, identity: ModelIdentity, n: int, *, namespace: str | None = None) -> WarmReport:
        """Read the ``n`` most valuable entries of ``identity`` (pinned, then most
        recently used; of ``namespace``, or of every namespace when None) into the
        host tier, as many as its budget holds, so their first lookups are served
        from RAM.  Needs ``host_cache``."""
        from .warm import warm

        if self.host is None:
            raise InvalidArgumentError("warm start needs a host tier: Store(..., host_cache=N)")
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"warm takes a count of entries, at least 0: {n!r}")
        if namespace is not None:
            check_name(namespace, "namespace")
        return warm(
            self.index,
            self.blobs,
            self.host,
            identity=identity,
            n=n,
            namespace=namespace,
            strict_backend=self.strict_backend,
        )

    def _info(self, r: SnapshotRow) -> EntryInfo:
        return listed_info(r)  # a row that does not decode is listed as damaged
