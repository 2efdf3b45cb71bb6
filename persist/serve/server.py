"""A durable prompt cache for mlx-lm's server: memory first, the store behind it.

``PersistentPromptCache`` has the interface mlx-lm's server uses
(``LRUPromptCache``: ``fetch_nearest_cache``, ``insert_cache``, ``trim_to``,
``nbytes``, ``stats_by_type``, ...).  Memory stays the first tier.  On a miss,
or when the store holds a strictly longer usable prefix, it restores from the
store.  Every insert is written behind to the store by one background thread
through a bounded queue; the server's own copy is never touched again (mlx-lm
hands out deep copies), and its arrays are evaluated before hand-off.  The
server's message-boundary snapshots of hybrid and sliding-window models are
stored as they come, so they serve prefix hits after a restart too.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from ..codecs.dispatch import cut_clean, serves_itself
from ..codecs.snapshot import capture
from ..engine.host.eviction import EvictionWatch
from ..engine.host.store_hooks import HOST, owner
from ..engine.host.tier import HostTier
from ..engine.layer_checks import quantized_start
from ..engine.store import Store
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from ..yielding import committing, giving_way
from .coverage import covered_key, one_short
from .handoff import handed_off, writer_stream
from .hints import HintedKeys, Hints
from .judgements import Judgements
from .keeper import EvictionKeeper
from .kept_keys import KeptKeys
from .memory_order import HintedOrder
from .metrics import ServeMetrics
from .penalty_context import note
from .quiet import RequestGate
from .stats_writer import StatsWriter
from .tenants import Scoped

__all__ = ["PersistentPromptCache"]

log = logging.getLogger("persist")


Resolver = Callable[[Any], "ModelIdentity | None"]
Queued = tuple[ModelIdentity, str, list[int], list[Any], "Hints | None"]  # a save, written behind
Behind = Callable[[], None]  # work for the writer thread (``hand_verdicts``)


def _no_wait() -> None:
    """No gate: the write-behind never waits for requests."""


def _constant(identity: ModelIdentity) -> Resolver:
    return lambda _key: identity


class PersistentPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache with the store behind it.

    ``identity`` is either one ModelIdentity (every cache is that model's) or
    a resolver from the server's model key (model path, adapter path, draft
    model path) to the identity of the model loaded under that key.  Every
    store entry is keyed by the identity of the model that computed it, and
    looked up by the identity of the model that will consume it; a key the
    resolver does not know never touches the store.
    """

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        store: Store,
        identity: ModelIdentity | Resolver,
        namespace: str = "default",
        queue_size: int = 64,
        when_full: str = "block",
        block_seconds: float = 30.0,
        metrics: ServeMetrics | None = None,
        host: HostTier | None = None,
        clock: Callable[[], float] = time.time,
        gate: RequestGate | None = None,
        stats: StatsWriter | None = None,
    ) -> None:
        super().__init__(max_size, max_bytes)
        # the write-behind's copies and writes wait while a request prompts (serve.quiet)
        self.gate = gate
        self._hinted = HintedKeys()  # the hints of what memory holds, for the host tier
        # mlx-lm's own eviction, honouring them within a namespace (serve.memory_order)
        self._lru = HintedOrder(self._hinted.get, lambda m: self._scope(m)[1], clock)
        self.host = host  # what mlx-lm evicts is kept there, asked before the store
        self._keeper: EvictionKeeper | None = None
        if host is not None:
            self._trie = EvictionWatch(self._trie, self._evicted)  # type: ignore[assignment]
            self._keeper = EvictionKeeper(  # the copies, off the generation thread
                host, on_error=lambda e: self.counters.update(keep_errors=1), gate=gate,
                gain=store.block_tokens,  # a lookup waits for a copy that adds a block
            )  # fmt: skip
        self.metrics = metrics  # persist serve's Prometheus metrics (apps.metrics)
        if metrics is not None:
            metrics.caches.append(self)
        self.store = store
        # counters reach the store from a thread of their own (serve.stats_writer)
        self._own_stats = stats is None
        self.stats = stats or StatsWriter(store, on_error=self._count_failed)
        self.identity_for: Resolver = (
            _constant(identity) if isinstance(identity, ModelIdentity) else identity
        )
        if when_full not in ("block", "drop"):
            raise InvalidArgumentError("when_full must be 'block' or 'drop'")
        self.namespace = namespace
        # Back-pressure when the disk is slower than generation: wait up to
        # block_seconds for room (the request was already answered), or drop.
        self.when_full, self.block_seconds = when_full, block_seconds
        self.counters: Counter[str] = Counter()
        self._kept = KeptKeys()  # what this process stored or queued: captured once
        # a tenant's counts, by namespace (serve.tenant_metrics); None: not kept
        self.on_count: Callable[[str, dict[str, int]], None] | None = None
        # captured on the writer thread, from the cache's layers (serve.handoff)
        self._queue: queue.Queue[Queued | Behind | None] = queue.Queue(queue_size)
        self.judgements = Judgements()  # lookups' verdicts, judged by the writer
        self._writer = threading.Thread(
            target=self._write_behind, name="persist-writer", daemon=True
        )
        self._writer.start()

    # -- the interface mlx-lm's server calls ---------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not rest and tokens:
            cache, rest = one_short(cache, tokens)
        if cache is not None:  # mlx-lm may have cut it, with each class's own trim
            cache = cut_clean(cache)
            if not self._served(model, cache):
                cache, rest = None, list(tokens)
        with self._on_thread("lookup"):
            cache, rest = self._nearer(model, tokens, cache, rest)
        note(cache, tokens[: len(tokens) - len(rest)])  # what penalties look back over
        return cache, rest

    def _served(self, model: Any, cache: Any) -> bool:
        """May memory's cache (mlx-lm may have cut it) be handed out?  The servable
        rules of its layers, under the identity's kv_bits start (persist.servable)."""
        identity = self.identity_for(self._scope(model)[0])
        start = quantized_start(identity) if identity is not None else None
        return serves_itself(cache, start)

    def _nearer(
        self, model: Any, tokens: list[int], cache: Any, rest: list[int]
    ) -> tuple[Any, list[int]]:
        """A longer prefix than mlx-lm's own (``cache``): from the host tier or the store."""
        have = len(tokens) - len(rest) if cache is not None else 0
        model, ns = self._scope(model)
        identity = self.identity_for(model)
        if identity is None:
            self._count(ns, unkeyed=1)
            if self.metrics is not None:
                self.metrics.prompt_only(len(tokens), have)
            return cache, rest
        m = self.metrics
        if have >= len(tokens) - 1:  # memory leaves one token: no tier holds longer
            self._count(ns, memory_hits=1)
            if m is not None:
                m.prompt_only(len(tokens), have)
            return cache, rest
        probe = m.probe() if m is not None else None
        if self._keeper is not None:  # the host tier as if evictions were kept in place
            # only this owner's copies that could serve this prompt
            self._keeper.settle(tokens, have, self._owner(identity, ns))
        try:
            # after memory, one order for every tier: host RAM, the fleet, the index
            # (engine.lookup_order); a host copy is made only if it is the longest
            hit = self.store.lookup(
                tokens, identity=identity, namespace=ns, longer_than=have, host=self.host
            )
        except Exception as e:  # the store must never take the server down
            self._count(ns, store_errors=1, memory_hits=int(cache is not None),
                        misses=int(cache is None))  # fmt: skip
            if m is not None:
                m.store_errors.inc()
            log.warning("persist: store lookup failed: %s", e)
            return cache, rest
        from_host = hit is not None and hit.source == HOST
        if m is not None and probe is not None:
            n = len(hit.tokens) if hit is not None and not from_host else 0
            host = len(hit.tokens) if hit is not None and from_host else 0
            m.looked_up(probe, len(tokens), have, n, self.store.costs.last, host=host)
        if hit is None:
            self._count(ns, memory_hits=int(cache is not None), misses=int(cache is None))
            return cache, rest
        if from_host:
            self._count(ns, host_hits=1, host_tokens=len(hit.tokens))
        else:
            self._count(ns, store_hits=1, restored_tokens=len(hit.tokens))
            log.info(
                "persist: restored %d of %d prompt tokens from the store",
                len(hit.tokens),
                len(tokens),
            )
        return hit.cache, list(tokens[len(hit.tokens) :])

    def _evicted(self, model: Any, tokens: list[int], cache: list[Any]) -> None:
        """Keep what mlx-lm evicts.  Called inside its bookkeeping (the entry is out of
        its trie, its bytes not yet subtracted): nothing may escape from here."""
        try:
            hints = self._hinted.pop(model, tokens)  # by the trie's own key
            model, ns = self._scope(model)
            identity = self.identity_for(model)
            if self._keeper is not None and identity is not None:
                with self._on_thread("keep"):  # a hand-over: serve.keeper copies it
                    handed_off(cache)  # a lazy slice is computed where it was made
                    if not self._keeper.offer(self._owner(identity, ns), tokens, cache, hints):
                        log.info("persist: an evicted cache was not kept: two are in flight")
        except Exception as e:  # the tier must never take the server down
            log.warning("persist: could not keep an evicted cache in the host cache: %s", e)

    def _owner(self, identity: ModelIdentity, ns: str) -> str:
        """The host tier's key for this cache's entries, as a Store keys its own: a
        HostTier shared by tenants (namespaces) or backends never crosses them."""
        return owner(ns, identity, self.store.strict_backend)

    def _scope(self, model: Any) -> tuple[Any, str]:
        """mlx-lm's model key and the namespace of a cache key: a ``Scoped`` key (a
        tenant's, ``serve.tenants``) names its own, a plain one is this cache's."""
        if isinstance(model, Scoped):
            return model.model, model.namespace
        return model, self.namespace

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
        hints: Hints | None = None,
    ) -> None:
        """mlx-lm's insert, then the write-behind; ``hints`` (ttl, priority): the
        request's retention hints for this cache (``serve.hints``)."""
        # kept under what its layers cover: a speculative turn's is one short of its key
        covered = covered_key(tokens, prompt_cache)
        if covered is None:
            log.warning("persist: a cache that covers no key was not kept")
            return
        tokens = covered
        # its hints first: the insert's own eviction (serve.memory_order) reads them
        self._hinted.add(model, tokens, hints, can_trim_prompt_cache(prompt_cache))
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        model, ns = self._scope(model)
        identity = self.identity_for(model)
        if identity is None:  # no identity vouches for it: memory only
            self._count(ns, unkeyed=1)
            return
        if self.store.read_only:  # served from, never written: memory only
            return
        key = self._kept.key(identity.digest, ns, tokens)
        if key in self._kept and hints is None:  # stored (or queued) these very tokens
            self._count(ns, captures_skipped=1)
            return
        try:
            # Only the hand-off runs here: the arrays evaluated on this thread's
            # stream (a lazy slice of a batch is computed where it was made).  The
            # copy to host bytes runs on the writer thread (issue 39): it never
            # delays the next request, and MLX arrays do not change once evaluated.
            with self._on_thread("handoff"):
                handed_off(prompt_cache)
        except Exception as e:  # a cache persist refuses (e.g. unknown kind) is skipped
            self._count(ns, persist_errors=1)
            log.warning("persist: could not persist a cache: %s", e)
            return
        item = (identity, ns, list(tokens), list(prompt_cache), hints)
        try:
            with self._on_thread("queue"):  # a full write-behind queue holds the thread
                if self.when_full == "block":
                    self._queue.put(item, timeout=self.block_seconds)
                else:
                    self._queue.put_nowait(item)
            self._kept.add(key)
        except queue.Full:
            self._count(ns, queue_drops=1)
            if self.metrics is not None:
                self.metrics.drops.inc()
            log.warning("persist: write-behind queue full; %d tokens not persisted", len(tokens))

    # -- write-behind --------------------------------------------------------

    def hand_verdicts(self) -> None:
        """Have the writer thread run the verdicts lookups handed over
        (``serve.judgements``); a writer busy with saves runs them between saves and
        before each commit anyway (a full queue: nothing more to do)."""
        if self.judgements.wake():
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(self.judgements.run_ready)

    def _write_behind(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if callable(item):  # hand_verdicts: its own errors are its own
                    item()
                    continue
                identity, ns, tokens, layers, hints = item
                m = self.metrics
                probe = m.probe(save=True) if m is not None else None
                ok = False
                ttl, priority = hints if hints is not None else (None, None)
                waits = self.gate.pauses() if self.gate is not None else _no_wait
                try:
                    j = self.judgements  # verdicts read no later save (serve.judgements)
                    with (
                        giving_way(waits),
                        committing(j.before_commit, j.after_commit),
                        writer_stream(),
                    ):
                        waits()  # a request that came with this cache goes first
                        snap = capture(layers, tokens)
                        del layers  # the host bytes are all the save needs from here
                        self.store.save(
                            snap, tokens, identity=identity, namespace=ns, ttl=ttl,
                            priority=priority,
                        )  # fmt: skip
                    ok = True
                finally:
                    if m is not None and probe is not None:
                        m.saved(probe, ok)
                self._count(ns, persisted=1)
            except Exception as e:  # a cache persist refuses (e.g. unknown kind) is skipped
                if self.metrics is not None:
                    self.metrics.store_failed(e)
                self._count(item[1] if isinstance(item, tuple) else self.namespace,
                            persist_errors=1)  # fmt: skip
                log.warning("persist: could not persist a cache: %s", e)
            finally:
                self.judgements.run_ready()  # those handed over while this item ran
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued insert is durable in the store, and every evicted
        cache handed over is kept in the host tier."""
        self._queue.join()
        if self._keeper is not None:
            self._keeper.settle()
        self.stats.flush()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()
        if self._keeper is not None:
            self._keeper.close()
        if self._own_stats:
            self.stats.close()

    @contextlib.contextmanager
    def _on_thread(self, step: str) -> Iterator[None]:
        """Time a step persist adds to the generation thread (``/metrics``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.metrics is not None:
                self.metrics.on_generation_thread(step, time.perf_counter() - start)

    def _tenant_count(self, ns: str, deltas: dict[str, int]) -> None:
        """Hand namespace ``ns``'s counts to /metrics by tenant, when kept (a request's
        lookups are counted once there: ``serve.tenant_serving``)."""
        if self.on_count is not None:
            self.on_count(ns, deltas)

    def _count(self, ns: str, **deltas: int) -> None:
        """Count in the process (``counters``) and in namespace ``ns``'s store counters."""
        deltas = {k: v for k, v in deltas.items() if v}
        self.counters.update(deltas)
        if deltas:
            self._tenant_count(ns, deltas)
        try:  # best effort: a full disk or a busy index never fails a request (counted)
            if deltas:  # in memory where the stats writer writes them (serve.stats_writer)
                self.store.count(ns, **{f"serve_{k}": v for k, v in deltas.items()})
        except Exception as e:
            self._count_failed(e)

    def _count_failed(self, e: Exception) -> None:
        if self.metrics is not None:
            self.metrics.store_failed(e, counter=True)
