"""``persist serve``: mlx-lm's server (``mlx_lm.server``) wired to persist.

``serve`` opens the store, builds the host tier and the metrics, replaces
mlx-lm's prompt cache with ``serve.server.PersistentPromptCache`` (per tenant:
``serve.tenant_serving``), its response generator and request handler with
persist's, loads and runs the model once before it listens, and stops in
order on SIGTERM.  The prompt cache itself lives in ``serve.server``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.host.placement import DEVICE_MEMORY, default_budget, placement
from ..engine.host.tier import HostTier
from ..engine.store import Store, check_name
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from .early_stop import early_stop
from .metrics import ServeMetrics
from .server import PersistentPromptCache
from .tenants import Tenants

__all__ = ["serve", "check_sizes", "host_budget", "keep_freed_buffers"]

log = logging.getLogger("persist")
MIN_REQUEST_BYTES = 1024  # below it no chat request fits: a server that refuses them all


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

    early = early_stop()  # SIGTERM while the model loads: an orderly stop (serve.early_stop)
    check_name(namespace, "namespace")  # before the model loads: a typed error, exit 1
    if max_request_bytes < MIN_REQUEST_BYTES:
        raise InvalidArgumentError(
            f"--max-request-bytes {max_request_bytes} takes no request: at least "
            f"{MIN_REQUEST_BYTES} bytes (a chat request's JSON)"
        )
    check_sizes(server_args or [])
    import mlx_lm.server as server

    early.check()  # a SIGTERM during the imports (seconds: transformers)

    from .allowed_models import listing_only
    from .bounds import limits_for
    from .explaining import miss_counter
    from .handler import PersistHandler, models_without_hf_cache
    from .http_edge import serve_until_signal
    from .logs import start_line, stop_line, use_log_format
    from .model_identity import track_identities
    from .penalty_context import patch as penalties_see_the_cache
    from .prefill_rates import measure_prefills
    from .quiet import RequestGate
    from .stats_writer import StatsWriter
    from .tenant_metrics import budget_line, count_by_tenant, tenancy_line
    from .tenant_serving import TenantGenerator, scoped_cache, tagging_batches, tenant_handler
    from .warm_start import first_forward, warmer

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
        namespace_max_bytes=tenant_max_bytes, cached_writes=True,
    )  # fmt: skip
    tidied = store.tidy()  # what killed writers left: no cron job for check --fix
    from ..engine.staged.restore import prepare

    prepare()  # CUDA: lanes up and kernels built before the first request (issue 39)
    store.preload()  # and the read and save paths imported
    metrics = ServeMetrics(store, namespace)
    # counters and prefill rates written off the generation thread (serve.stats_writer)
    stats = StatsWriter(store, on_error=lambda e: metrics.store_failed(e, counter=True))
    measure_prefills(server, stats, lambda model: by_model.get(id(model)))
    penalties_see_the_cache(server)
    metrics.misses = miss_counter(metrics.registry)
    honour = not tenancy.multi or tenant_max_bytes is not None  # serve.hints: budgets
    budget = host_budget(host_cache)
    metrics.host = host = HostTier(budget) if budget > 0 else None
    pinned_line = None
    if host is not None and host.holder is not None:
        t0 = time.perf_counter()  # pinned now: pinning beside requests stalls them
        pinned_now = host.reserve()
        took_pinning = time.perf_counter() - t0
        pinned_line = (
            f"persist: host tier: {pinned_now >> 20} MiB of {host.where} pinned in "
            f"{took_pinning:.2f} s"
        )
    warming = warmer(store, host, warm)
    if warming is not None:
        warmers.append(warming)
    if host is not None:
        host.owner_max_bytes = tenant_max_bytes  # a tenant's share of the host tier too
    caches: list[PersistentPromptCache] = []
    TenantPromptCache = scoped_cache(PersistentPromptCache)
    # the write-behind waits while a request prompts, 2 s at most per cache (serve.quiet)
    metrics.gate = gate = RequestGate()

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
            gate=gate,
            stats=stats,
        )
        count_by_tenant(pc, metrics, tenancy)
        pc.hints_honoured = honour
        caches.append(pc)
        return pc

    real_run = server.run

    def run(host: str, port: int, model_provider: Any, *args: Any, **kwargs: Any) -> None:
        use_log_format(log_format)  # mlx-lm's main has configured logging by now
        line = start_line(
            store,
            namespace,
            shared=shared,
            cold=cold,
            queue=queue_size,
            when_full=when_full,
            host=metrics.host,
        )
        log.info(line)
        if pinned_line is not None:  # logged once mlx-lm has set logging up
            log.info(pinned_line)
        if tidied:
            log.info("persist: removed %d leftovers of interrupted saves", len(tidied))
        if store.read_only:
            log.warning("persist: store %s is read-only: serving, saving nothing", store.root)
        level, line = tenancy_line(tenancy, shared)
        log.log(level, line)
        over = budget_line(tenancy, tenant_max_bytes, store.budgets.max_bytes)
        if over is not None:
            log.warning(over)
        if not honour:
            log.warning("persist: retention hints in requests are ignored: tenants share the "
                        "store's budget (give --tenant-max-bytes to honour them)")  # fmt: skip
        # loaded, run once (kernels built) and warmed before the server listens
        early.check()
        took = first_forward(model_provider)
        if took is not None:
            log.info("persist: model loaded and its kernels built in %.2f s", took)
        early.check()
        # the generation thread starts in there: a signal is noted until the server's
        # own handlers act on it (serve.early_stop)
        early.defer_interrupts()
        real_run(host, port, model_provider, *args, **kwargs)

    server.LRUPromptCache = make  # type: ignore[assignment,misc]
    server.ResponseGenerator = type(  # type: ignore[misc,assignment]
        "TenantGenerator", (TenantGenerator,), {"gate": gate}
    )
    # over the class measure_prefills made: both the timing and the tags
    server.BatchGenerator = tagging_batches(server.BatchGenerator)  # type: ignore[assignment,misc]
    limits = limits_for(model_dir, model_names, allowed_models, max_tokens_limit)
    handler = type(
        "PersistHandler", (PersistHandler,), {"limits": limits, "public_marks": tenancy.marks}
    )
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
        pending=early.pending,
    )
    sys.argv = ["mlx_lm.server", "--model", str(model_dir), *(server_args or [])]
    try:
        server.main()
    finally:
        for pc in caches:
            pc.close()
        stats.close()
        log.info(stop_line(metrics.summary(), store))
        store.close()


# mlx-lm's options that must be 1 or more: at 0 its server started, then hung on the
# first request (or, below 0, failed every one) (attack 39h)
AT_LEAST_ONE = ("--prefill-step-size", "--prompt-concurrency", "--decode-concurrency")


def check_sizes(server_args: Sequence[str]) -> None:
    """InvalidArgumentError for one of AT_LEAST_ONE below 1 among mlx-lm's options (a
    value that is not a number is mlx-lm's own argparse's to refuse)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    for name in AT_LEAST_ONE:
        parser.add_argument(name)
    # every occurrence: mlx-lm's argparse converts each one it is given (attack r17c)
    parser.add_argument("--prompt-cache-bytes", action="append", default=[])
    known, _ = parser.parse_known_args(list(server_args))
    for raw in known.prompt_cache_bytes:
        _check_bytes(raw)
    for name in AT_LEAST_ONE:
        raw = getattr(known, name.lstrip("-").replace("-", "_"))
        try:
            value = int(raw) if raw is not None else 1
        except ValueError:
            continue
        if value < 1:
            raise InvalidArgumentError(
                f"{name} {value} serves nothing: at least 1 (mlx-lm's server would hang "
                "on its first request or fail every one)"
            )


def _check_bytes(raw: str) -> None:
    """InvalidArgumentError for a ``--prompt-cache-bytes`` mlx-lm's size parser cannot
    read: it raised KeyError or decimal's error (a traceback, attack r17b)."""
    from mlx_lm.utils import _parse_size

    try:
        if _parse_size(raw) >= 0:
            return
    except Exception:  # KeyError for a unit it lacks, InvalidOperation for no number
        pass
    raise InvalidArgumentError(
        f"--prompt-cache-bytes {raw[:40]!r} is not a size: a number of bytes, or one "
        "with M, G, MB or GB (mlx-lm's units: no K, no T)"
    )


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
