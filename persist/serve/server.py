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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mlx_lm.models.cache import LRUPromptCache

from ..codecs.dispatch import cut_clean, serves_itself
from ..codecs.snapshot import Snapshot, capture
from ..engine.host.store_hooks import owner, served
from ..engine.host.tier import DEVICE_MEMORY, EvictionWatch, HostTier, default_budget, placement
from ..engine.layer_checks import quantized_start
from ..engine.store import Store
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from .coverage import covered_key
from .kept_keys import KeptKeys
from .metrics import ServeMetrics
from .tenants import Scoped, Tenants

__all__ = ["PersistentPromptCache", "keep_freed_buffers", "host_budget"]

log = logging.getLogger("persist")


Resolver = Callable[[Any], "ModelIdentity | None"]


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
    ) -> None:
        super().__init__(max_size, max_bytes)
        self.host = host  # what mlx-lm evicts is kept there, asked before the store
        if host is not None:
            self._trie = EvictionWatch(self._trie, self._evicted)  # type: ignore[assignment]
        self.metrics = metrics  # persist serve's Prometheus metrics (apps.metrics)
        if metrics is not None:
            metrics.caches.append(self)
        self.store = store
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
        self._queue: queue.Queue[tuple[ModelIdentity, str, list[int], Snapshot] | None] = (
            queue.Queue(queue_size)
        )
        self._writer = threading.Thread(
            target=self._write_behind, name="persist-writer", daemon=True
        )
        self._writer.start()

    # -- the interface mlx-lm's server calls ---------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None:  # mlx-lm may have cut it, with each class's own trim
            cache = cut_clean(cache)
            if not self._served(model, cache):
                cache, rest = None, list(tokens)
        with self._on_thread("lookup"):
            return self._nearer(model, tokens, cache, rest)

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
        memory, near = have, self._from_host(identity, ns, tokens, have)
        if near is not None:
            cache, rest, have = near.cache, list(tokens[len(near.tokens) :]), len(near.tokens)
        try:
            # one index pass: a hit no longer than memory's or the host's is not read
            hit = self.store.lookup(tokens, identity=identity, namespace=ns, longer_than=have)
            if m is not None and probe is not None:
                n = len(hit.tokens) if hit is not None else 0
                host = len(near.tokens) if near is not None else 0
                m.looked_up(probe, len(tokens), memory, n, self.store.costs.last, host=host)
            if hit is not None:
                self._count(ns, store_hits=1, restored_tokens=len(hit.tokens))
                log.info(
                    "persist: restored %d of %d prompt tokens from the store",
                    len(hit.tokens),
                    len(tokens),
                )
                return hit.cache, list(tokens[len(hit.tokens) :])
        except Exception as e:  # the store must never take the server down
            self._count(ns, store_errors=1)
            if self.metrics is not None:
                self.metrics.store_errors.inc()
            log.warning("persist: store lookup failed: %s", e)
        if near is not None:
            self._count(ns, host_hits=1, host_tokens=len(near.tokens))
        else:
            self._count(ns, memory_hits=int(cache is not None), misses=int(cache is None))
        return cache, rest

    def _from_host(self, identity: ModelIdentity, ns: str, tokens: list[int], have: int) -> Any:
        """A host-tier hit longer than memory's (a fresh copy), its rate told to the costs."""
        if self.host is None:
            return None
        try:
            who = self._owner(identity, ns)
            return served(self.host, self.store.costs, identity, who, tokens, have)
        except Exception as e:  # the tier must never take the server down
            log.warning("persist: host cache lookup failed: %s", e)
            return None

    def _evicted(self, model: Any, tokens: list[int], cache: list[Any]) -> None:
        """Keep what mlx-lm evicts.  Called inside its bookkeeping (the entry is out of
        its trie, its bytes not yet subtracted): nothing may escape from here."""
        try:
            model, ns = self._scope(model)
            identity = self.identity_for(model)
            if self.host is not None and identity is not None:
                with self._on_thread("keep"):
                    self.host.keep(self._owner(identity, ns), tokens, cache)
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
    ) -> None:
        # kept under what its layers cover: a speculative turn's is one short of its key
        covered = covered_key(tokens, prompt_cache)
        if covered is None:
            log.warning("persist: a cache that covers no key was not kept")
            return
        tokens = covered
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        model, ns = self._scope(model)
        identity = self.identity_for(model)
        if identity is None:  # no identity vouches for it: memory only
            self._count(ns, unkeyed=1)
            return
        if self.store.read_only:  # served from, never written: memory only
            return
        key = self._kept.key(identity.digest, ns, tokens)
        if key in self._kept:  # this process stored (or queued) these very tokens
            self._count(ns, captures_skipped=1)
            return
        try:
            # Encoded and evaluated here, on the generation thread: the writer
            # then handles host bytes only and never waits on this thread's stream.
            with self._on_thread("capture"):
                snap = capture(prompt_cache, tokens)
        except Exception as e:  # a cache persist refuses (e.g. unknown kind) is skipped
            self._count(ns, persist_errors=1)
            log.warning("persist: could not persist a cache: %s", e)
            return
        item = (identity, ns, list(tokens), snap)
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

    def _write_behind(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                identity, ns, tokens, snap = item
                m = self.metrics
                probe = m.probe(save=True) if m is not None else None
                ok = False
                try:
                    self.store.save(snap, tokens, identity=identity, namespace=ns)
                    ok = True
                finally:
                    if m is not None and probe is not None:
                        m.saved(probe, ok)
                self._count(ns, persisted=1)
            except Exception as e:  # a cache persist refuses (e.g. unknown kind) is skipped
                if self.metrics is not None:
                    self.metrics.store_failed(e)
                self._count(item[1] if item else self.namespace, persist_errors=1)
                log.warning("persist: could not persist a cache: %s", e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued insert is durable in the store."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    @contextlib.contextmanager
    def _on_thread(self, step: str) -> Iterator[None]:
        """Time a step persist adds to the generation thread (``/metrics``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.metrics is not None:
                self.metrics.on_generation_thread(step, time.perf_counter() - start)

    def _count(self, ns: str, **deltas: int) -> None:
        """Count in the process (``counters``) and in namespace ``ns``'s store counters."""
        deltas = {k: v for k, v in deltas.items() if v}
        self.counters.update(deltas)
        if self.on_count is not None and deltas:
            self.on_count(ns, deltas)
        try:  # best effort: a full disk or a busy index never fails a request (counted)
            if deltas:
                self.store.count(ns, **{f"serve_{k}": v for k, v in deltas.items()})
        except Exception as e:
            if self.metrics is not None:
                self.metrics.store_failed(e, counter=True)


def serve(
    model_dir: str,
    store_root: Any,
    *,
    max_bytes: int | None = None,
    namespace: str = "default",
    server_args: list[str] | None = None,
    backlog: int = 128,
    drain_timeout: float = 60.0,
    queue_size: int = 64,
    when_full: str = "block",
    shared: str | None = None,
    cold: str | None = None,
    tier_key: bytes | None = None,
    mlx_cache: int | None = None,
    read_timeout: float = 30.0,
    max_request_bytes: int = 4 << 20,
    log_format: str = "text",
    host_cache: int | None = None,
    max_connections: int = 128,
    max_tokens_limit: int | None = None,
    allowed_models: Sequence[str] = (),
    model_names: Sequence[str] = (),
    tenants: Tenants | None = None,
    tenant_max_bytes: int | None = None,
    warm: int = 0,
) -> None:
    """Run mlx-lm's server (``mlx_lm.server``) with the store behind its prompt cache.

    Blocks until SIGTERM or Ctrl-C, then stops in order: no new connections,
    the accepted requests finish (up to ``drain_timeout`` seconds), the
    write-behind queue is flushed, the store closed.  A second signal exits
    at once.  If generation stops for good, the same stop runs and
    InvalidStateError is raised (the CLI exits 1).  ``mlx_cache``: see
    ``keep_freed_buffers``; ``read_timeout``, ``max_request_bytes``, ``max_connections``:
    ``server_handler``, ``server_http``; ``host_cache``: bytes of evicted caches kept in
    RAM (``engine.host.tier``; None: ``host_budget``; 0: none).  ``max_tokens_limit``,
    ``allowed_models`` (beside the served model and ``model_names``, its other names):
    ``serve.bounds``, ``serve.allowed_models``.  ``tenants``: who is asking and the
    public prefixes (``serve.tenants``; None: single-tenant); ``tenant_max_bytes``: the
    store's budget for each namespace (tenant).
    ``warm``: each model loaded gets its ``warm`` most valuable entries read into the
    host tier (the default model before the server listens; ``serve.warm_start``).
    """
    import functools
    import sys

    import mlx_lm.server as server

    from .allowed_models import listing_only
    from .bounds import limits_for
    from .handler import PersistHandler, models_without_hf_cache
    from .http_edge import serve_until_signal
    from .logs import start_line, stop_line, use_log_format
    from .model_identity import track_identities
    from .prefill_rates import measure_prefills
    from .tenant_metrics import count_by_tenant, tenancy_line
    from .tenant_serving import TenantGenerator, scoped_cache, tagging_batches, tenant_handler
    from .warm_start import warmer

    tenancy = tenants or Tenants(namespace)

    keep_freed_buffers(mlx_cache)
    by_model: dict[int, ModelIdentity] = {}
    warmers: list[Callable[[ModelIdentity], None]] = []  # set once the store is open

    def warm_loaded(identity: ModelIdentity) -> None:
        for w in warmers:
            w(identity)

    identities = track_identities(server, by_model, warm_loaded)
    store = Store(
        store_root, max_bytes=max_bytes, shared=shared, cold=cold, tier_key=tier_key,
        namespace_max_bytes=tenant_max_bytes,
    )  # fmt: skip
    tidied = store.tidy()  # what killed writers left: no cron job for check --fix
    from ..engine.staged.restore import prepare

    prepare()  # CUDA: lanes up and kernels built before the first request (issue 39)
    measure_prefills(server, store, lambda model: by_model.get(id(model)))
    metrics = ServeMetrics(store, namespace)
    budget = host_budget(host_cache)
    metrics.host = host = HostTier(budget) if budget > 0 else None
    warming = warmer(store, host, warm)
    if warming is not None:
        warmers.append(warming)
    if host is not None:
        host.owner_max_bytes = tenant_max_bytes  # a tenant's share of the host tier too
    caches: list[PersistentPromptCache] = []
    TenantPromptCache = scoped_cache(PersistentPromptCache)

    def make(max_size: int = 10, max_bytes: int = 1 << 63) -> PersistentPromptCache:
        pc = TenantPromptCache(
            max_size,
            max_bytes,
            tenants=tenancy,
            store=store,
            identity=identities.get,
            namespace=namespace,
            queue_size=queue_size,
            when_full=when_full,
            metrics=metrics,
            host=host,
        )
        count_by_tenant(pc, metrics, tenancy)
        caches.append(pc)
        return pc

    real_run = server.run

    def run(host: str, port: int, model_provider: Any, *args: Any, **kwargs: Any) -> None:
        use_log_format(log_format)  # mlx-lm's main has configured logging by now
        log.info(start_line(store, namespace, shared, cold, queue_size, when_full, metrics.host))
        if tidied:
            log.info("persist: removed %d leftovers of interrupted saves", len(tidied))
        if store.read_only:
            log.warning("persist: store %s is read-only: serving, saving nothing", store.root)
        level, line = tenancy_line(tenancy, shared)
        log.log(level, line)
        if warmers:  # loaded (and so warmed) before the server listens, not on first use
            model_provider.load_default()
        real_run(host, port, model_provider, *args, **kwargs)

    server.LRUPromptCache = make  # type: ignore[assignment,misc]
    server.ResponseGenerator = TenantGenerator  # type: ignore[misc]
    # over the class measure_prefills made: both the timing and the tags
    server.BatchGenerator = tagging_batches(server.BatchGenerator)  # type: ignore[assignment,misc]
    limits = limits_for(model_dir, model_names, allowed_models, max_tokens_limit)
    handler = type("PersistHandler", (PersistHandler,), {"limits": limits})
    handler = tenant_handler(handler, tenancy)
    server.scan_cache_dir = listing_only(
        models_without_hf_cache(server.scan_cache_dir), limits.models
    )
    server.run = run
    server._run_http_server = functools.partial(
        serve_until_signal,
        server,
        backlog=backlog,
        drain_timeout=drain_timeout,
        handler=handler,
        metrics=metrics,
        read_timeout=read_timeout,
        max_request_bytes=max_request_bytes,
        max_connections=max_connections,
    )
    sys.argv = ["mlx_lm.server", "--model", str(model_dir), *(server_args or [])]
    try:
        server.main()
    finally:
        for pc in caches:
            pc.close()
        log.info(stop_line(metrics.summary(), store))
        store.close()


def host_budget(host_cache: int | None) -> int:
    """The host tier's bytes: ``host_cache`` if given, else the default budget where
    the tier keeps entries off the device (host or pinned host memory); none on CUDA
    without pinned memory, where it would hold what mlx-lm's eviction meant to free."""
    if host_cache is not None:
        return host_cache
    return 0 if placement() == DEVICE_MEMORY else default_budget()


def keep_freed_buffers(limit: int | None) -> int | None:
    """Let MLX's CPU backend keep up to ``limit`` bytes of freed buffers for reuse
    (None: its memory limit, as MLX does on GPUs); the old limit, or None off the CPU.

    On the CPU MLX keeps only 32 MiB, so every restored cache (and every
    growth of a live one) faults in fresh pages: 2-3x the cost of reading
    the bytes on a VM.  A server restores all day; its freed caches should
    be reused as they are on Metal and CUDA.
    """
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    return int(mx.set_cache_limit(mx.get_memory_limit() if limit is None else limit))
