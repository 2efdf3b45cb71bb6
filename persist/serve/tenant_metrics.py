"""``/metrics`` by tenant, with bounded label cardinality, and the start line's tenancy.

Every count the prompt cache makes names its namespace
(``PersistentPromptCache.on_count``); here it is filed under the tenant
that namespace belongs to (salted namespaces under their tenant, the
public prefixes under ``(public)``).  A request is one lookup, under the
tenant that sent it, with the tier that answered (``CountsOnce``: its
lookups in its own namespace and the public one are held, then counted as
the one whose cache it got); one the public prefix answered also counts in
``public_hits``, so ``(public)`` has bytes but no lookups of its own.  A
scrape shows the ``TOP`` tenants by lookups and sums the rest under
``(other)``: a server with 100,000 tenants
still has a page of a few dozen series.  Names come from the key file or
a checked header (letters, digits, ``._@:+=-``), never raw request bytes;
the reserved labels are in parentheses, which no tenant name holds, so a
tenant named ``other`` or ``public`` is never summed with them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..storage.retention import budget_owner, owned_bytes
from .tenants import Tenants

__all__ = [
    "CountsOnce",
    "TenantCounts",
    "count_by_tenant",
    "one_lookup",
    "tenancy_line",
    "budget_line",
    "tenant_of",
]

log = logging.getLogger("persist")
TOP = 20  # tenants with series of their own; the rest are OTHER
# reserved labels: parentheses are in no tenant name (serve.tenants.TENANT)
PUBLIC, NONE, OTHER = "(public)", "(none)", "(other)"
HITS = ("memory_hits", "host_hits", "store_hits")
# what a lookup's result is (the tier that answered, or a miss), and the tokens it gave
RESULT = (*HITS, "misses", "host_tokens", "restored_tokens")
Counts = list[tuple[str, dict[str, int]]]  # (namespace, deltas) as a lookup reported them


def one_lookup(namespace: str, own: Counts, public: Counts, served_public: bool) -> Counts:
    """A request's lookups in its own namespace and the public one, as one: the result of
    the lookup whose cache was handed out, under the request's ``namespace`` (with
    ``public_hits`` when the public prefix answered); every other count (errors) under
    the namespace it happened in."""
    chosen = public if served_public else own
    out: Counts = []
    result: dict[str, int] = {"public_hits": 1} if served_public else {}
    for held in (own, public):
        for ns, deltas in held:
            other = {k: v for k, v in deltas.items() if k not in RESULT}
            if other:
                out.append((ns, other))
            if held is chosen:
                for k in RESULT:
                    result[k] = result.get(k, 0) + deltas.get(k, 0)
    result = {k: v for k, v in result.items() if v}
    return [(namespace, result), *out] if result else out


class CountsOnce:
    """Before a PersistentPromptCache: while a request's lookups run (``holding``), the
    per-tenant counts they report are held in a list instead of filed, so the request
    files them once (``one_lookup``)."""

    _held = threading.local()

    def _tenant_count(self, ns: str, deltas: dict[str, int]) -> None:
        held = getattr(self._held, "counts", None)
        if held is not None:
            held.append((ns, deltas))
        else:
            super()._tenant_count(ns, deltas)  # type: ignore[misc]

    @contextlib.contextmanager
    def _tenant_holding(self, into: Counts) -> Iterator[None]:
        """Hold the per-tenant counts lookups on this thread report, in ``into``."""
        before = getattr(self._held, "counts", None)
        self._held.counts = into
        try:
            yield
        finally:
            self._held.counts = before


def tenant_of(namespace: str, tenants: Tenants) -> str:
    """The metrics label of a namespace: its tenant, ``(public)``, or ``(none)``
    (single-tenant)."""
    if namespace == tenants.public_namespace:
        return PUBLIC
    head = f"{tenants.namespace}/tenant:"
    if namespace.startswith(head):
        return budget_owner(namespace)[len(head) :]
    return NONE


class TenantCounts:
    """Lookups and bytes by tenant, collected at scrape time (a prometheus collector)."""

    def __init__(self, tenants: Tenants, store: Any, top: int = TOP) -> None:
        self.tenants, self.store, self.top = tenants, store, top
        self._lock = threading.Lock()
        self._counts: dict[str, Counter[str]] = {}
        self._owners: dict[str, str] = {}  # label -> the namespace its budget is counted by
        if tenants.public or tenants.marks:  # its bytes are shown, though it looks nothing up
            self._counts[PUBLIC] = Counter()
            self._owners[PUBLIC] = budget_owner(tenants.public_namespace)

    def count(self, namespace: str, deltas: dict[str, int]) -> None:
        label = tenant_of(namespace, self.tenants)
        with self._lock:
            self._counts.setdefault(label, Counter()).update(deltas)
            self._owners.setdefault(label, budget_owner(namespace))

    def ranked(self) -> list[tuple[str, Counter[str]]]:
        """The top tenants by lookups, then ``(other)`` with everyone else summed."""
        with self._lock:
            items = [(k, Counter(v)) for k, v in self._counts.items()]
        items.sort(key=lambda kv: (-_lookups(kv[1]), kv[0]))
        top, rest = items[: self.top], items[self.top :]
        if rest:
            other: Counter[str] = Counter()
            for _, c in rest:
                other.update(c)
            top.append((OTHER, other))
        return top

    def collect(self) -> Iterator[Any]:
        ranked = self.ranked()
        lookups = CounterMetricFamily(
            "persist_tenant_lookups",
            f"Prompt-cache lookups by tenant (top {self.top}, the rest '{OTHER}') and result.",
            labels=["tenant", "result"],
        )
        public = CounterMetricFamily(
            "persist_tenant_public_hits",
            "Of a tenant's hits, those the public prefixes answered (top tenants, "
            f"the rest '{OTHER}').",
            labels=["tenant"],
        )
        stored = GaugeMetricFamily(
            "persist_tenant_store_bytes",
            "Bytes the store holds for a tenant, its salts included: what --tenant-max-bytes "
            "counts (top tenants only).",
            labels=["tenant"],
        )
        for label, c in ranked:
            lookups.add_metric([label, "hit"], sum(c[h] for h in HITS))
            lookups.add_metric([label, "miss"], c["misses"])
            if label != PUBLIC:
                public.add_metric([label], c["public_hits"])
            if label != OTHER:
                stored.add_metric([label], self._bytes(label))
        yield lookups
        yield public
        yield stored

    def _bytes(self, label: str) -> float:
        with self._lock:
            owner = self._owners.get(label)
        if owner is None:
            return 0.0
        try:  # the budget's own sum over the tenant's salts; a busy store is skipped
            with self.store.index.read() as db:
                return float(owned_bytes(db, owner))
        except Exception as e:
            log.debug("persist: tenant bytes not read: %r", e)
            return float("nan")


def _lookups(c: Counter[str]) -> int:
    return sum(c[h] for h in HITS) + c["misses"]


def count_by_tenant(cache: Any, metrics: Any, tenants: Tenants) -> TenantCounts:
    """Count ``cache``'s lookups by tenant on ``metrics``' registry (once per registry)."""
    counts = getattr(metrics, "tenant_counts", None)
    if counts is None:
        counts = metrics.tenant_counts = TenantCounts(tenants, metrics.store)
        metrics.registry.register(counts)
    cache.on_count = counts.count
    return counts


def tenancy_line(tenants: Tenants, shared: str | None) -> tuple[int, str]:
    """The start line's word on tenancy, and its log level (a warning when one namespace
    is shared by every client, louder still across a fleet)."""
    public = f"; {len(tenants.public)} public prefix(es) shared" if tenants.public else ""
    if tenants.marks:  # any tenant may write into what every tenant reads
        public += "; requests may mark their system prompt public (--allow-public-marks)"
    if tenants.keys:
        return logging.INFO, (
            f"persist serve: tenants by API key ({len(tenants.keys)} keys): each tenant and "
            f"cache_salt is its own namespace in every tier{public}"
        )
    if tenants.header is not None:
        return logging.INFO, (
            f"persist serve: tenants by the {tenants.header} header (set it at a trusted "
            f"gateway): each tenant and cache_salt is its own namespace in every tier{public}"
        )
    fleet = (
        " and every server on the shared tier: ANY CLIENT OF THE FLEET CAN READ OTHERS' PROMPTS"
        if shared
        else ""
    )
    return logging.WARNING, (
        f"persist serve: single-tenant: every client shares namespace {tenants.namespace!r}"
        f"{fleet} (cached_tokens and timing tell a client what others sent); set --api-keys "
        f"or --tenant-header to keep tenants apart, or send cache_salt{public}"
    )


def budget_line(tenants: Tenants, tenant_max: int | None, store_max: int | None) -> str | None:
    """A warning for the start when the tenants' budgets add up past the store's: a
    tenant within its budget then finds the store full once others filled it, and its
    saves are refused (attack r15).  With keys the tenants are counted (the public
    namespace is one more where prefixes are shared); by header they are not, so the
    line says how many fit.  None when they fit, or either budget is unset."""
    if not tenants.multi or tenant_max is None or store_max is None or tenant_max <= 0:
        return None
    if tenants.keys:
        n = len(set(tenants.keys.values())) + int(bool(tenants.public or tenants.marks))
        if n * tenant_max <= store_max:
            return None
        return (
            f"persist serve: {n} tenants x --tenant-max-bytes {tenant_max} is "
            f"{n * tenant_max} bytes, past the store's budget of {store_max}: once the "
            "store is full a tenant within its own budget has its saves refused (give "
            f"--max-bytes {n * tenant_max} or more)"
        )
    fit = store_max // tenant_max
    return (
        f"persist serve: the store's budget of {store_max} bytes holds {fit} tenants at "
        f"--tenant-max-bytes {tenant_max}; past that, a tenant within its own budget has "
        "its saves refused once the store is full"
    )
