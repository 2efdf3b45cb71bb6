"""Prefill timings of mlx-lm's server, into the store's cost model (restore or recompute).

``persist serve`` patches mlx-lm's ``stream_generate`` and ``BatchGenerator``
so that every prefill the server runs is measured where it happens; the
store then knows, per machine and model, whether restoring a hit beats
prefilling its tokens again (``engine/costs``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..engine.store import Store
from .stats_writer import StatsWriter

__all__ = ["measure_prefills"]

log = logging.getLogger("persist")


def measure_prefills(
    server: Any, store: Store | StatsWriter, identity_of: Callable[[Any], Any]
) -> None:
    """Patch mlx-lm's server so its prefills feed the store's cost model.

    One request at a time (``stream_generate``): mlx-lm's own prompt time of
    the first response.  Batched (``BatchGenerator``): the prompt time its
    counters add during each ``next()``, at the batch's context positions.
    ``identity_of`` maps a loaded model object to its identity; a ``StatsWriter``
    writes the rates from its own thread (``persist serve``), a Store here and now.
    """
    real_stream, real_batch = server.stream_generate, server.BatchGenerator

    def record(model: Any, start: int, end: int, seconds: float) -> None:
        try:  # a measurement never disturbs serving (an mlx-lm that changed, a busy store)
            ident = identity_of(model)
            if ident is None or not (end > start and seconds > 0):
                return
            if isinstance(store, StatsWriter):  # written behind, off this thread
                store.prefilled(ident, start, end, seconds)
            else:
                store.record_prefill(ident, start, end, seconds)
        except Exception as e:
            log.debug("persist: prefill not measured: %s", e)

    def stream_generate(*args: Any, **kwargs: Any) -> Any:
        model, start = kwargs.get("model"), _offset(kwargs.get("prompt_cache"))
        for i, r in enumerate(real_stream(*args, **kwargs)):
            n, tps = getattr(r, "prompt_tokens", 0), getattr(r, "prompt_tps", 0.0)
            if i == 0 and tps > 0:
                record(model, start, start + n, n / tps)
            yield r

    class BatchGenerator(real_batch):  # type: ignore[misc,valid-type]
        def next(self) -> Any:
            counters = getattr(self, "_counters", None)
            before = (getattr(counters, "prompt_tokens", 0), getattr(counters, "prompt_time", 0.0))
            out = super().next()
            n = getattr(counters, "prompt_tokens", 0) - before[0]
            secs = getattr(counters, "prompt_time", 0.0) - before[1]
            try:
                ends = [r.progress[0] for r in out[0] if getattr(r, "progress", None)]
            except Exception:  # another mlx-lm's responses: not measured
                ends = []
            if n > 0 and ends:
                # each sequence got n/len tokens in secs: a single prompt is no slower
                end = sum(ends) // len(ends)
                record(getattr(self, "model", None), max(0, end - n // len(ends)), end, secs)
            return out

    server.stream_generate, server.BatchGenerator = stream_generate, BatchGenerator


def _offset(cache: Any) -> int:
    try:
        return int(getattr(cache[0], "offset", 0) or 0) if cache else 0
    except Exception:
        return 0
