"""Snapshots between the local store and a shared tier: push after a commit, pull on a miss.

A snapshot travels as a *record* (its index row, its block list by content
key, each blob's size and header checksum, bound to its namespace and name and
sealed by ``tier_records``) plus its blobs.  Pulling writes the blobs into the
local store, checked against the record before anything is committed, then
commits the row exactly as a local save would; from then on the local store
serves it.  A tier that fails never fails the local operation: the caller
counts it and goes on.  A value that is not what its key claims is a miss,
counted by why (``<tier>_malformed``, ``_mismatched``, ``_unauthenticated``), and
so is a session's version older than one this store saw (``_stale``: a replay).
"""

from __future__ import annotations

import logging
from typing import Any

from ...remote.redis_tier import RedisTier, TierUnavailable
from ...remote.s3_tier import S3Tier
from ...storage.blobs import BlobStore
from ...storage.index import Index
from .fleet_block import require_same_block
from .fleet_plan import refused_first
from .fleet_sync import sync
from .lineage import Foreign, shown_url
from .named_pull import UNREADABLE, Unreadable, named_record, repair
from .namespace_secret import namespace_secret
from .prefix_pull import PrefixPulls
from .pull import EvictedError, pull, relation
from .push import push
from .records import BadValue, Keys, check_key, tier_key_from_env

__all__ = ["Shared", "push", "pull", "sync", "EvictedError", "open_tiers"]


log = logging.getLogger("persist")
ROTATION_HINT = (
    "if the fleet deleted it or another machine holds a newer turn, persist rm it here; "
    "if it was planted, delete that value from the tier and sync --rekey again"
)
Tier = RedisTier | S3Tier
ASK_AGAIN_S = 10.0  # a keyless secret (or its absence) is asked for again after this


class Shared(PrefixPulls):
    """A Store's shared tier: which namespaces agree with it, and the operations that
    never fail the local one (a tier that is down or refuses is counted and skipped)."""

    def __init__(
        self, tier: Tier, name: str = "shared", keys: Keys | None = None, backup: Tier | None = None
    ) -> None:
        self.tier, self.name = tier, name  # name: the prefix of its counters in persist stats
        self.keys = keys if keys is not None else Keys()
        self.backup = backup  # the cold tier, where a secret the shared one lost is kept
        self._held: dict[str, tuple[bytes, float]] = {}  # namespace -> (secret, ask again at)
        self._none_until: dict[str, float] = {}
        self.unreachable = 0  # operations the tier was down for (sync tells a miss from these)
        self.conflicts: list[tuple[str, str]] = []  # (session, NAME~N it was pushed as)
        self.refused: list[tuple[str, str]] = []  # (session, why): another key's value there
        self.rekey = False  # sync(rekey=True): this key is the fleet's, others' are replaced
        self.behind_said = False  # a pull served without the cold tier was said (named_pull)
        self.unread: str | None = None  # why the last pull_session could not read its session
        self.held_here: str | None = None  # its session to this store's (pull_session's over)
        # (tier's name, tier, why) of a version the last pull_session refused as a replay:
        # a restore is "not found" (a deleted copy's new history goes beside), a pull
        # reports it unreadable (``fleet_sync._pull_one``)
        self.replayed: tuple[str, Any, str] | None = None

    def _count(self, index: Index, namespace: str, what: str) -> None:
        index.count(namespace, **{f"{self.name}_{what}": 1})

    def _bad(self, index: Index, namespace: str, e: BadValue) -> None:
        self._count(index, namespace, e.why)
        log.info("persist: %s tier value refused: %s", self.name, e.detail)

    def agree(self, index: Index, namespace: str, create: bool = False) -> bool:
        """Is this namespace's secret on the tier known (a store without one of its own
        adopts it before its first save)?  Only a save (``create``) puts a secret on the
        tier: a read never creates a namespace anywhere."""
        return self.secret(index, namespace, create) is not None

    def secret(self, index: Index, namespace: str, create: bool = False) -> bytes | None:
        """The tier's chain secret for the namespace (None: none yet).  Without a key it
        is asked for again every ASK_AGAIN_S (one GET): a tier that lost it and got
        another from a new machine is followed, never split from."""
        require_same_block(self, index, namespace, create)  # one block size per fleet
        now, held = self.tier.clock(), self._held.get(namespace)
        if held is not None and now < held[1]:
            return held[0]
        if held is None and not create and now < self._none_until.get(namespace, 0.0):
            return None  # nothing anywhere a moment ago: no scan on every lookup
        last = held[0] if held else None
        got = self._run(lambda: namespace_secret(self, index, namespace, create, last))
        if got is None:
            if last is None:
                self._none_until[namespace] = now + ASK_AGAIN_S
            return last  # the tier is down: what it was a moment ago
        self._hold(namespace, got)
        return got

    def _hold(self, namespace: str, secret: bytes) -> None:
        again = float("inf") if self.keys.key is not None else ASK_AGAIN_S  # derived: fixed
        self._held[namespace] = (secret, self.tier.clock() + again)

    def _run(self, op: Any) -> Any:
        try:
            return op()
        except TierUnavailable as e:
            self.unreachable += not e.denied  # an ACL's refusal is an answer
            return None

    def _bytes(self, index: Index, namespace: str, before: dict[str, int]) -> None:
        """Bytes this operation moved, into the store's counters (persist stats)."""
        for what in ("bytes_pushed", "bytes_pulled"):
            n = self.tier.counters.get(what, 0) - before.get(what, 0)
            if n:
                index.count(namespace, **{f"{self.name}_{what}": n})

    def push(
        self,
        index: Index,
        blobs: BlobStore,
        namespace: str,
        sid: int,
        verify: bool = False,
        as_name: str | None = None,
        base: tuple[float | None] | None = None,
        beside: bool = False,
        replace_foreign: bool = False,
        live: bool = False,
    ) -> str:
        """Push one committed snapshot: ``pushed``, ``present`` (the tier had all of it),
        ``conflict`` (a session that does not continue the tier's one of its name, written
        beside it as ``NAME~N``), ``skipped`` (not this tier's, or gone meanwhile) or
        ``failed``; ``verify``: read every value the tier holds of it (``sync``), not
        once per process.  A session kept beside the tier's is added to ``conflicts``
        also when that fork was there already (``present``: nothing written), so sync
        lists it each time and never counts it pushed again.  ``refused`` (a foreign value
        there) before anything is written, unless rekey or ``replace_foreign``.  ``live``:
        another tier holds this copy's own history (``fleet_plan.Plan.live``, ``push``)."""
        if refused_first(self, index, namespace, sid, as_name, replace_foreign):
            return "refused"
        secret = self.secret(index, namespace, create=True)
        if secret is None:
            self._count(index, namespace, "errors")
            return "failed"
        before = dict(self.tier.counters)
        replaced: list[str] = []
        for _ in range(2):
            forks = len(self.conflicts)
            try:
                got = self._run(
                    lambda s=secret: push(
                        index, blobs, self.tier, keys=self.keys, namespace=namespace, sid=sid,
                        secret=s, verify=verify, conflicts=self.conflicts, as_name=as_name,
                        base=base, beside=beside, rekey=self.rekey, replace=replace_foreign,
                        replaced=replaced,
                        live=live,
                    )
                )  # fmt: skip
            except Foreign as e:  # maybe the fleet's session, under a key this one is not
                self._bytes(index, namespace, before)
                self.refuse(index, namespace, e.name, e.detail)
                return "refused"
            done, after = got if got is not None else (None, None)
            if after is None or after == secret:
                break
            # the tier holds another secret (it lost ours, and another machine planted
            # its own first): the fleet's from now on, and this record again under it
            self._hold(namespace, after)
            secret = after
        for name in replaced:  # a planted value, or the old key's: counted and said
            self._count(index, namespace, "foreign_replaced")
            log.warning("persist: %s tier's %r: an unauthenticated value replaced", self.name, name)
        return self._pushed(index, namespace, done, forks, before)

    def refuse(
        self, index: Index, namespace: str, name: str, detail: str, rotating: bool = False
    ) -> None:
        """A session not pushed: the tier's value under its name is not authenticated
        under this machine's key (``lineage.Foreign``); counted, said, listed by sync.
        ``rotating``: under ``--rekey``, a value that would have stopped the push (a
        tombstone, a newer turn) but that no key here can tell from a plant."""
        self._count(index, namespace, "conflicts")
        if rotating:
            why = f"the {self.name} tier ({shown_url(self.tier.url)}) holds {detail}"
            hint = ROTATION_HINT
        else:
            why = self._why(self.name, self.tier, f"{detail}; not replaced", True)
            hint = "persist sync --rekey replaces it, where this machine's key is the fleet's"
        self.refused.append((name, why))
        log.warning("persist: session %r saved here only, not pushed: %s (%s)", name, why, hint)

    def _pushed(
        self, index: Index, namespace: str, done: str | None, forks: int, before: dict[str, int]
    ) -> str:
        """``push``'s answer, counted."""
        if done in ("pushed", None):
            self._count(index, namespace, "pushes" if done else "errors")
        self._bytes(index, namespace, before)
        if done is not None and len(self.conflicts) > forks:
            self._count(index, namespace, "conflicts")
            name, kept = self.conflicts[-1]
            log.warning(
                "persist: session %r here does not continue the %s tier's %r; pushed as %r "
                "beside it",
                name, self.name, name, kept,
            )  # fmt: skip
            return "conflict" if done == "pushed" else done
        return done or "failed"

    def pull_session(
        self, index: Index, blobs: BlobStore, namespace: str, name: str, over: Any = None
    ) -> bool:
        """A named session the local store lacks, from the tier (CorruptBlobError if a
        blob is damaged); False where the tier is down or has no good record of it.
        With a cold tier behind this one, its pointer is asked first and the session
        read there where this tier's is not the same, this one's then repaired
        (``named_pull``).  ``over``: this store's own row of the name, replaced only by a
        newer version that continues it; ``held_here`` says what the tier's is to it
        (``pull.relation``; None: nothing readable there)."""
        self.unread = self.held_here = self.replayed = None
        secret = self.secret(index, namespace)
        try:
            found = self._run(lambda: named_record(self, index, namespace, name, secret))
        except Unreadable as e:  # named there, not readable here: never "no session"
            self._count(index, namespace, "misses")
            self.unread = self._why(e.name, e.tier, e.detail, e.keyed)
            return False
        if found is None:
            self._count(index, namespace, "misses")
            return False
        if over is not None:  # pulled only over a copy the fleet's session continues
            self.held_here = relation(found.body["row"], over)
            if self.held_here != "newer":
                return False
        tier, counted = found.tier, found.name  # the cold tier's bytes, its counters
        before = dict(tier.counters)
        try:
            if found.secret is not None and index.secret(namespace) is None:
                index.set_secret(namespace, found.secret)  # recovered from the record itself
            pulled = self._run(
                lambda: pull(
                    index,
                    blobs,
                    tier,
                    keys=self.keys,
                    namespace=namespace,
                    body=found.body,
                    named=True,
                    replace=over.id if over is not None else None,
                )
            )
            if pulled:
                index.count(namespace, **{f"{counted}_hits": 1})
                index.saw(namespace, name, float(found.body["row"]["created"]))
        except EvictedError as e:  # the LRU took part of it: named there, not readable
            self._count(index, namespace, "incomplete")
            self.unread = self._why(counted, tier, f"part of it is gone ({e})", False)
            return False
        except BadValue as e:
            self._bad(index, namespace, e)
            if e.why == "conflict":  # a save here took the name meanwhile (38f, F3)
                now = index.by_name(namespace, name)
                self.held_here = relation(found.body["row"], now) if now else None
            if e.why in UNREADABLE:
                self.unread = self._why(counted, tier, e.detail, True)
            return False
        finally:
            for what in ("bytes_pushed", "bytes_pulled"):
                n = tier.counters.get(what, 0) - before.get(what, 0)
                if n:
                    index.count(namespace, **{f"{counted}_{what}": n})
        if pulled and found.stale is not None:
            repair(self, index, blobs, namespace, name, found)
        return bool(pulled)

    def replay_why(self) -> str | None:
        """Why the last ``pull_session`` took nothing, where it refused a replay."""
        if self.replayed is None:
            return None
        where, tier, detail = self.replayed
        return f"the {where} tier ({shown_url(tier.url)}) names it, but {detail}"

    def _why(self, name: str, tier: Any, detail: str, keyed: bool) -> str:
        """What SessionUnreadableError says of this tier: which one, and the key."""
        text = f"the {name} tier ({shown_url(tier.url)}) names it, but {detail}"
        if not keyed:
            return text + " (an evicted or expired value)"
        if self.keys.key is None:
            return text + " (this machine has no operator key, $PERSIST_TIER_KEY)"
        kid = self.keys.blob_name("")[1:]  # the key id blob names on the tiers carry
        return text + f" (this machine's operator key, key id {kid}, is not the fleet's)"


def open_tiers(
    shared: str | None, cold: str | None, tier_key: bytes | None = None
) -> tuple[Shared | None, Shared | None]:
    """The shared (Redis) and cold (S3) tiers of these URLs (None where not given), and
    the operator key (``tier_key``, else ``$PERSIST_TIER_KEY``) that authenticates them."""
    keys = Keys(check_key(tier_key) if tier_key is not None else tier_key_from_env())
    c = Shared(S3Tier(cold), "cold", keys) if cold else None
    s = Shared(RedisTier(shared), "shared", keys, c.tier if c else None) if shared else None
    return s, c
