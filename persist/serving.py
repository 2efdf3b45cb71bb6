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

import logging
import queue
import threading
from collections import Counter
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from .identity import ModelIdentity
from .sessions import Store

__all__ = ["PersistentPromptCache"]

log = logging.getLogger("persist")


class PersistentPromptCache(LRUPromptCache):
    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        store: Store,
        identity: ModelIdentity,
        namespace: str = "default",
        queue_size: int = 16,
    ) -> None:
        super().__init__(max_size, max_bytes)
        self.store = store
        self.identity = identity
        self.namespace = namespace
        self.counters: Counter[str] = Counter()
        self._queue: queue.Queue[tuple[list[int], list[Any]] | None] = queue.Queue(queue_size)
        self._writer = threading.Thread(
            target=self._write_behind, name="persist-writer", daemon=True
        )
        self._writer.start()

    # -- the interface mlx-lm's server calls ---------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        have = len(tokens) - len(rest) if cache is not None else 0
        try:
            found = self.store.find(tokens, identity=self.identity, namespace=self.namespace)
            if found is not None and found[1] > have:
                hit = self.store.lookup(tokens, identity=self.identity, namespace=self.namespace)
                if hit is not None and len(hit.tokens) > have:
                    self._count(store_hits=1, restored_tokens=len(hit.tokens))
                    log.info(
                        "persist: restored %d of %d prompt tokens from the store",
                        len(hit.tokens),
                        len(tokens),
                    )
                    return hit.cache, list(tokens[len(hit.tokens) :])
        except Exception as e:  # the store must never take the server down
            self._count(store_errors=1)
            log.warning("persist: store lookup failed: %s", e)
        self._count(memory_hits=1 if cache is not None else 0, misses=1 if cache is None else 0)
        return cache, rest

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        mx.eval([c.state for c in prompt_cache])  # evaluated before the hand-off
        try:
            self._queue.put_nowait((list(tokens), prompt_cache))
        except queue.Full:
            self._count(queue_drops=1)
            log.warning("persist: write-behind queue full; %d tokens not persisted", len(tokens))

    # -- write-behind --------------------------------------------------------

    def _write_behind(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                tokens, cache = item
                self.store.save(cache, tokens, identity=self.identity, namespace=self.namespace)
                self._count(persisted=1)
            except Exception as e:  # a cache persist refuses (e.g. unknown kind) is skipped
                self._count(persist_errors=1)
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

    def _count(self, **deltas: int) -> None:
        deltas = {k: v for k, v in deltas.items() if v}
        self.counters.update(deltas)
        if deltas:
            self.store.index.count(self.namespace, **{f"serve_{k}": v for k, v in deltas.items()})


def serve(
    model_dir: str,
    store_root: Any,
    *,
    max_bytes: int | None = None,
    namespace: str = "default",
    server_args: list[str] | None = None,
) -> None:
    """Run mlx-lm's server (``mlx_lm.server``) with the store behind its prompt cache.

    Blocks until the server stops (Ctrl-C or SIGTERM), then flushes the
    write-behind queue so everything accepted is durable.
    """
    import signal
    import sys

    import mlx_lm.server as server

    identity = ModelIdentity.from_path(model_dir)
    store = Store(store_root, max_bytes=max_bytes)
    caches: list[PersistentPromptCache] = []

    def make(max_size: int = 10, max_bytes: int = 1 << 63) -> PersistentPromptCache:
        pc = PersistentPromptCache(
            max_size, max_bytes, store=store, identity=identity, namespace=namespace
        )
        caches.append(pc)
        return pc

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt  # mlx-lm's server shuts down cleanly on it

    server.LRUPromptCache = make  # type: ignore[assignment,misc]
    signal.signal(signal.SIGTERM, stop)
    sys.argv = ["mlx_lm.server", "--model", str(model_dir), *(server_args or [])]
    try:
        server.main()
    finally:
        for pc in caches:
            pc.close()
        log.info("persist: store stats %s", store.stats().to_dict())
        store.close()
