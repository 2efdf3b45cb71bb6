"""The gauges of ``persist serve``'s /metrics page, read when it is scraped.

Queue depth, generation alive and failures, abandoned requests, tier
breakers, store and host-tier bytes against their budgets: read from a
``ServeMetrics`` (``serve.metrics``) at scrape time, never counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ScrapeGauges", "Scraped"]


class Scraped(Protocol):
    """What the gauges read of ``metrics.ServeMetrics`` (a protocol: no import circle)."""

    store: Any
    host: Any
    generator: Any
    gate: Any

    def queue(self) -> tuple[int, int]: ...
    def generation_alive(self) -> bool: ...
    def tiers(self) -> dict[str, str]: ...
    def tier_refusals(self) -> dict[str, int]: ...
    def read_store_bytes(self) -> int: ...


class ScrapeGauges:
    """What is read at scrape time: queue, generation, tiers, store bytes against budget."""

    def __init__(self, m: Scraped) -> None:
        self.m = m

    def collect(self) -> Iterator[Any]:
        m = self.m
        depth, room = m.queue()
        yield _gauge(
            "persist_write_queue_depth",
            "Caches waiting to be written behind, or in writing.",
            depth,
        )
        yield _gauge("persist_write_queue_capacity", "Room in the write-behind queue.", room)
        yield _gauge(
            "persist_generation_alive", "1 while the generation thread serves requests.",
            int(m.generation_alive()),
        )  # fmt: skip
        failures = CounterMetricFamily(
            "persist_generation_failures", "Generation-loop failures survived (requests failed)."
        )
        failures.add_metric([], getattr(m.generator, "failures", 0))
        yield failures
        yield from _abandoned(m.generator)
        if m.gate is not None:
            gave = CounterMetricFamily(
                "persist_write_behind_gave_way_seconds",
                "Seconds the write-behind waited for requests in their prompt phase.",
            )
            gave.add_metric([], m.gate.waited)
            yield gave
        up = GaugeMetricFamily(
            "persist_tier_up", "1 unless the tier's breaker skips it after a failure.",
            labels=["tier"],
        )  # fmt: skip
        for name, state in m.tiers().items():
            up.add_metric([name], int(state == "up"))
        yield up
        refused = CounterMetricFamily(
            "persist_tier_refusals",
            "Operations a tier answered no to (out of memory, an ACL): each failed.",
            labels=["tier"],
        )
        for name, n in m.tier_refusals().items():
            refused.add_metric([name], n)
        yield refused
        yield _gauge("persist_store_bytes", "Bytes the store holds on disk.", m.read_store_bytes())
        if m.host is not None:
            got = m.host.stats()
            yield _gauge("persist_host_cache_bytes", "Bytes the host-RAM tier holds.", got["bytes"])
            yield _gauge(
                "persist_host_cache_budget_bytes", "The host-RAM tier's budget (--host-cache).",
                got["budget_bytes"],
            )  # fmt: skip
        budget = m.store.budgets.max_bytes
        if budget is not None:
            yield _gauge("persist_store_budget_bytes", "The store's budget (--max-bytes).", budget)


def _abandoned(generator: Any) -> Iterator[CounterMetricFamily]:
    """Requests whose client left before the answer (``serve.disconnect``), and the tokens
    generated for them after that: what they cost once nobody would read them."""
    gone = CounterMetricFamily(
        "persist_requests_abandoned", "Requests stopped because their client closed."
    )
    gone.add_metric([], getattr(generator, "abandoned", 0))
    wasted = CounterMetricFamily(
        "persist_abandoned_tokens", "Tokens generated for a request after its client closed."
    )
    wasted.add_metric([], getattr(generator, "wasted_tokens", 0))
    return iter((gone, wasted))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
