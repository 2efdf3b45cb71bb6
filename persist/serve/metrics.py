"""What ``persist serve`` tells an operator: Prometheus metrics, ``/health``, a stop summary.

One ``CollectorRegistry`` per server (never prometheus_client's global one:
two servers in one process, or a test, must not share counters).  Events
are counted where they happen (the prompt cache's lookups on the
generation thread, its saves on the writer thread, the HTTP handlers);
gauges (queue depth, tier breakers, generation alive) are read at scrape
time (``serve.scrape_gauges``).  Counters are this process's since it started, as Prometheus
expects; ``persist stats`` keeps the store's own totals across restarts.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from ..engine.costs import LOCAL, LOCAL_DISK
from ..errors import StoreFullError
from ..storage.housekeeping import wal_bytes
from .prompt_counts import Outcome, Outcomes
from .scrape_gauges import ScrapeGauges

__all__ = ["ServeMetrics", "CONTENT_TYPE"]

log = logging.getLogger("persist")
F = TypeVar("F", bound=Callable[..., Any])

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LOCK_WAIT = 2.0  # seconds /health waits for the index before calling the store unreachable


def _never_raises(f: F) -> F:
    """A metric that fails is logged and skipped: it never fails a lookup or a save."""

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except Exception as e:
            log.debug("persist: a metric was not recorded: %r", e)
            return None

    return cast(F, run)


@dataclass
class Probe:
    """What a lookup or save starts from: the time, and what each tier has moved so far."""

    t0: float
    key: str  # the tier counter it watches: bytes_pulled (a lookup) or bytes_pushed (a save)
    moved: dict[str, int]
    written: int = 0


class ServeMetrics:
    """The metrics of one ``persist serve``: ``text()`` is the /metrics page."""

    def __init__(self, store: Any, namespace: str = "default") -> None:
        self.store, self.namespace = store, namespace
        self.started = time.time()
        self.caches: list[Any] = []  # PersistentPromptCache objects (their write queues)
        self.generator: Any = None  # the GuardedGenerator, once mlx-lm's server made it
        self.host: Any = None  # the host-RAM tier (engine.host_tier.HostTier), if any
        self.gate: Any = None  # requests in their prompt phase (serve.quiet.RequestGate)
        self.store_bytes = 0
        self.store_problem: str | None = None  # the last store write's failure, until one succeeds
        self.read_store_bytes()  # what a store from an earlier run holds already
        disable_created_metrics()  # no *_created series: a scrape is a page an operator reads
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "persist_requests", "HTTP requests answered.", ["endpoint", "code"], registry=r
        )
        self.prompt_tokens = Counter("persist_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_tokens = Counter(
            "persist_cached_prompt_tokens",
            "Prompt tokens served from a cache (memory or the store) instead of a prefill.",
            registry=r,
        )
        self.lookups = Counter(
            "persist_cache_lookups",
            "Prompt-cache lookups by source (memory, host, local, shared, cold) and result.",
            ["source", "result"],
            registry=r,
        )
        self.restore_seconds = Histogram(
            "persist_restore_seconds", "Store lookups that restored a cache, by source.",
            ["source"], buckets=SECONDS, registry=r,
        )  # fmt: skip
        self.save_seconds = Histogram(
            "persist_save_seconds", "Write-behind saves (tier pushes included).",
            buckets=SECONDS, registry=r,
        )  # fmt: skip
        self.generation_seconds = Histogram(
            "persist_generation_thread_seconds",
            "Time persist spends on mlx-lm's generation thread, by step (lookup: the host "
            "tier and the store asked; handoff: a cache's arrays evaluated for the writer "
            "thread, which copies them to host bytes; queue: "
            "waiting for room in the write-behind queue; keep: an evicted cache handed to the "
            "keeper thread, which copies it to the host tier): what it adds to a request's "
            "latency.",
            ["step"], buckets=SECONDS, registry=r,
        )  # fmt: skip
        self.read_bytes = Counter(
            "persist_tier_read_bytes", "Bytes read, by tier.", ["tier"], registry=r
        )
        self.written_bytes = Counter(
            "persist_tier_written_bytes", "Bytes written, by tier.", ["tier"], registry=r
        )
        self.writes = Counter(
            "persist_writes", "Write-behind saves by result (saved, error).", ["result"], registry=r
        )
        self.drops = Counter(
            "persist_write_queue_drops", "Caches not persisted: the write queue was full.",
            registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "persist_restore_decisions",
            "Restore-or-recompute decisions on a store hit (decision, reason).",
            ["decision", "reason"],
            registry=r,
        )
        self.store_errors = Counter(
            "persist_store_errors", "Store lookups that failed (the request was served anyway).",
            registry=r,
        )  # fmt: skip
        self.counter_errors = Counter(
            "persist_store_counter_errors", "Store counter updates skipped (a full disk, a busy "
            "index); the request was served anyway.", registry=r,
        )  # fmt: skip
        self.misses: Counter | None = None  # by reason (serve.explaining.miss_counter)
        r.register(ScrapeGauges(self))
        self.outcomes = Outcomes(self._counted)  # each request's prompt once (prompt_counts)

    # -- recording -------------------------------------------------------------

    @_never_raises
    def on_generation_thread(self, step: str, seconds: float) -> None:
        self.generation_seconds.labels(step).observe(seconds)

    @_never_raises
    def probe(self, save: bool = False) -> Probe | None:
        """Start a lookup or a save: the clock and what the tiers moved so far.

        Only lookups pull (on the generation thread) and only saves push (on
        the writer thread), so each watches its own counter."""
        key = "bytes_pushed" if save else "bytes_pulled"
        moved = {t.name: t.tier.counters.get(key, 0) for t in self.store.tiers}
        return Probe(time.perf_counter(), key, moved, self._bytes_written() if save else 0)

    @_never_raises
    def looked_up(
        self, probe: Probe, prompt: int, memory: int, hit: int, cost: Any, host: int = 0
    ) -> None:
        """One keyed lookup: ``memory`` tokens the memory tier had, ``host`` the host
        tier restored (longer than memory's), ``hit`` the store restored."""
        seconds = time.perf_counter() - probe.t0
        sources = [("memory", bool(memory))]
        if self.host is not None:
            sources.append(("host", bool(host and not hit)))
            if host and not hit:
                self.restore_seconds.labels("host").observe(seconds)
        pulled = self._moved(probe)
        source = next((name for name, n in pulled.items() if n and hit), "local" if hit else None)
        sources += [(name, name == source) for name in ("local", *probe.moved)]
        self.outcomes.report(Outcome(prompt, max(memory, host, hit), tuple(sources)))
        if source is not None:
            self.restore_seconds.labels(source).observe(seconds)
        for name, n in pulled.items():  # a pull reads the tier and writes this machine
            self.read_bytes.labels(name).inc(n)
            self.written_bytes.labels("local").inc(n)
        if cost is not None:
            self.decisions.labels("restore" if cost.restore else "recompute", cost.reason).inc()
            if cost.restore and hit and cost.tier in (LOCAL, LOCAL_DISK):  # this store's files
                self.read_bytes.labels("local").inc(cost.nbytes)

    @_never_raises
    def saved(self, probe: Probe, ok: bool) -> None:
        self.save_seconds.observe(time.perf_counter() - probe.t0)
        self.writes.labels("saved" if ok else "error").inc()
        for name, n in self._moved(probe).items():
            self.written_bytes.labels(name).inc(n)
        after = self._bytes_written()
        self.written_bytes.labels("local").inc(max(0, after - probe.written))
        if ok:
            self.store_problem = None
        self.read_store_bytes()

    def read_store_bytes(self) -> int:
        """The store's bytes (a sum its triggers keep: no scan); the last value if unreadable."""
        with contextlib.suppress(Exception):  # a metric never fails a save or a scrape
            self.store_bytes = int(self.store.index.unique_bytes())
        return self.store_bytes

    @_never_raises
    def store_failed(self, e: BaseException, counter: bool = False) -> None:
        """A store write failed (served anyway): /health shows it until a save succeeds."""
        if counter:
            self.counter_errors.inc()
        self.store_problem = "full" if _is_full(e) else f"error: {type(e).__name__}"

    @_never_raises
    def prompt_only(self, prompt: int, memory: int) -> None:
        """A prompt no identity vouches for: the memory tier only, the store not asked."""
        self.outcomes.report(Outcome(prompt, memory, (("memory", bool(memory)),)))

    @_never_raises
    def _counted(self, o: Outcome) -> None:
        """One request's lookup: its prompt, what was served, each source asked."""
        self.prompt_tokens.inc(o.prompt)
        self.cached_tokens.inc(o.cached)
        for source, hit in o.sources:
            self.lookups.labels(source, "hit" if hit else "miss").inc()

    def request(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint, str(code)).inc()

    def _moved(self, probe: Probe) -> dict[str, int]:
        now = {t.name: t.tier.counters.get(probe.key, 0) for t in self.store.tiers}
        return {name: max(0, now.get(name, 0) - n) for name, n in probe.moved.items()}

    def _bytes_written(self) -> int:
        # the store's own counter of blob bytes a save wrote (after dedup)
        try:
            return int(self.store.index.counters(self.namespace).get("bytes_written", 0))
        except Exception:  # a metric never fails a save
            return 0

    # -- reading ---------------------------------------------------------------

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def queue(self) -> tuple[int, int]:
        """(caches waiting to be written or being written, room for them)."""
        return (
            sum(pc._queue.unfinished_tasks for pc in self.caches),
            sum(pc._queue.maxsize for pc in self.caches),
        )

    def generation_alive(self) -> bool:
        g = self.generator
        return g is not None and bool(g.generation_available())

    def tiers(self) -> dict[str, str]:
        """Each tier's breaker: 'down' while persist skips it after a failure."""
        now = time.monotonic()
        return {
            t.name: "down" if getattr(t.tier, "_down_until", 0.0) > now else "up"
            for t in self.store.tiers
        }

    def tier_refusals(self) -> dict[str, int]:
        """Operations each tier refused (``remote/refusals``): each failed, no breaker."""
        refusals = {t.name: getattr(t.tier, "refusals", None) for t in self.store.tiers}
        return {name: r.total if r is not None else 0 for name, r in refusals.items()}

    def store_reachable(self) -> bool:
        """The index answers within LOCK_WAIT seconds and the folder is writable (a
        store opened read-only is served without writing: its index answering is all)."""
        try:
            index = self.store.index
            if not index.lock.acquire(timeout=LOCK_WAIT):
                return False
            try:
                with index.read() as db:
                    db.execute("SELECT 1").fetchone()
            finally:
                index.lock.release()
            return self.store.read_only or os.access(self.store.root, os.W_OK)
        except Exception:  # closed, damaged, gone: all unreachable to an operator
            return False

    def health(self) -> dict[str, Any]:
        alive, reachable, tiers = self.generation_alive(), self.store_reachable(), self.tiers()
        depth, room = self.queue()
        g = self.generator
        ok = reachable and self.store_problem is None and "down" not in tiers.values()
        status = "ok" if ok else "degraded"
        return {
            "status": status if alive else "unavailable",
            "generation": {
                "alive": alive,
                "failures": getattr(g, "failures", 0),
                "stopped": getattr(g, "death", None),
            },
            "write_queue": {"depth": depth, "capacity": room, "drops": int(self.value(
                "persist_write_queue_drops_total"))},
            "store": {"path": str(self.store.root), "reachable": reachable,
                      "mode": "read-only" if self.store.read_only else "read-write",
                      "state": self.store_problem or "ok", "bytes": self.read_store_bytes(),
                      "budget_bytes": self.store.budgets.max_bytes,
                      "wal_bytes": wal_bytes(self.store.root)},
            "tiers": tiers,
            **({"host_cache": self.host.stats()} if self.host is not None else {}),
        }  # fmt: skip

    def summary(self) -> str:
        """The stop log's one line: what this process did."""
        prompt = self.value("persist_prompt_tokens_total")
        cached = self.value("persist_cached_prompt_tokens_total")
        hits = {
            s: int(self.value("persist_cache_lookups_total", source=s, result="hit"))
            for s in (
                "memory",
                *(["host"] if self.host is not None else []),
                "local",
                *(t.name for t in self.store.tiers),
            )
        }
        saved = int(self.value("persist_writes_total", result="saved"))
        errors = int(self.value("persist_writes_total", result="error"))
        share = f" ({100 * cached / prompt:.0f}%)" if prompt else ""
        return (
            f"{_duration(time.time() - self.started)}, "
            f"{int(sum(_samples(self.registry, 'persist_requests_total')))} requests; "
            f"{int(cached)} of {int(prompt)} prompt tokens cached{share}; hits "
            + ", ".join(f"{s} {n}" for s, n in hits.items())
            + f"; {saved} caches persisted, {int(self.value('persist_write_queue_drops_total'))}"
            f" dropped, {errors} write errors"
            + "".join(
                f", {n} refused by the {t} tier" for t, n in self.tier_refusals().items() if n
            )
        )


def _is_full(e: BaseException) -> bool:
    """A full disk or budget, whichever layer said so (StoreFullError, ENOSPC, SQLite's)."""
    seen: BaseException | None = e
    for _ in range(8):  # a chain of causes, bounded (a chain can loop)
        if seen is None:
            break
        if isinstance(seen, StoreFullError) or getattr(seen, "errno", None) in FULL_ERRNOS:
            return True
        if "full" in str(seen).lower():  # sqlite3: "database or disk is full"
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _samples(registry: CollectorRegistry, name: str) -> Iterator[float]:
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name:
                yield s.value


def _duration(s: float) -> str:
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"up {h}h{m:02d}m" if h else f"up {m}m{sec:02d}s"
