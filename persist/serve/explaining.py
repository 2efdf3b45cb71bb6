"""Why ``persist serve`` reused less of a prompt than it shares with what is stored.

Every keyed lookup that does not reuse the prompt's whole prefix (all of it but
the last token, the most any cache gives) is judged against the store as the
lookup saw it: on the write-behind's thread when it has nothing queued or in
writing, queued before the request's own caches are saved (a miss pays no
index reads on the generation thread); on the generation thread, right after
the lookup, when the request waits for its verdict or a save waits (one
committed before a later verdict made a miss look like a hit; timed as step
``explain`` of ``persist_generation_thread_seconds``).  A judgement is a bounded
``Store.explain`` (``storage.nearest``: a few index seeks and a few dozen rows,
whatever the store holds), weighed against what the lookup served from any
tier and what the cost model decided.  A verdict that is not a hit
counts in ``persist_misses_total{reason}``, the fixed ``REASONS`` codes as
labels.

A client that sends ``X-Persist-Explain: 1`` gets its verdict: a response
header (``X-Persist-Explain: reason=...; shared=N; usable=N; cached=N``), in a
non-streaming JSON answer the field ``"persist": {"explain": {...}}``, and one
line in the server log.  Only the request's own namespace is read, and only
counts, codes and field names are told: never a token, a text or another
tenant's anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from ..engine.explain import REASONS
from ..identity import ModelIdentity
from ..storage.chains import HEAD_TOKENS
from .request_checks import BadRequest

__all__ = [
    "ExplainSlot", "Verdict", "judge", "judged", "wanted", "explain_asked", "miss_counter",
    "HEADER",
]  # fmt: skip

log = logging.getLogger("persist")
HEADER = "X-Persist-Explain"
YES, NO = frozenset({"1", "true", "yes"}), frozenset({"0", "false", "no"})
MISS_REASONS = tuple(r for r in REASONS if r != "hit")


@dataclass(frozen=True, kw_only=True)
class Verdict:
    reason: str  # a REASONS code
    prompt: int  # prompt tokens
    cached: int  # tokens this request reused, from any tier
    shared: int  # the longest prefix it shares with what is stored (at least cached)
    usable: int  # the longest prefix a lookup may reuse for this model (at least cached)
    fields: list[str] = field(default_factory=list)  # identity fields that differ, by name
    cost: dict[str, Any] | None = None  # the cost model's predicted times, when declined

    def header(self) -> str:
        return (
            f"reason={self.reason}; shared={self.shared}; usable={self.usable}; "
            f"cached={self.cached}"
        )

    def extension(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "reason": self.reason,
            "message": REASONS[self.reason],
            "prompt_tokens": self.prompt,
            "cached_tokens": self.cached,
            "shared_tokens": self.shared,
            "usable_tokens": self.usable,
        }
        if self.fields:
            out["identity_fields"] = self.fields
        if self.cost is not None:
            out["cost"] = self.cost
        return out


class ExplainSlot:
    """Where the generation thread leaves a request's verdict for its handler."""

    def __init__(self) -> None:
        self.verdict: Verdict | None = None
        self.ready = threading.Event()


def explain_asked(headers: Any) -> bool:
    """Whether the request asks for its verdict (``X-Persist-Explain``: 1, true, yes
    or 0, false, no); BadRequest for a value that is neither, or for headers that
    disagree."""
    values = headers.get_all(HEADER) or []
    said = set()
    for value in values:
        v = value.strip().lower()
        if v not in YES and v not in NO:
            raise BadRequest(f"{HEADER} must be 1 or 0 (true or false), not {value!r}")
        said.add(v in YES)
    if len(said) > 1:  # the first was taken silently (attack r14b)
        raise BadRequest(f"{HEADER} is sent {len(values)} times and the values disagree")
    return said == {True}


def miss_counter(registry: CollectorRegistry) -> Counter:
    """``persist_misses_total{reason}``: every label there from the start, at 0."""
    c = Counter(
        "persist_misses",
        "Prompt-cache lookups that reused less than the prompt shares with what is stored "
        "(misses and shortened hits), by reason (persist explain's codes).",
        ["reason"],
        registry=registry,
    )
    for r in MISS_REASONS:
        c.labels(r)
    return c


def judge(
    store: Any,
    identity: ModelIdentity,
    namespace: str,
    tokens: list[int],
    *,
    cached: int,
    decision: Any,
    asked: bool,
    damaged: bool = False,
) -> Verdict | None:
    """The verdict on a lookup that reused ``cached`` of ``tokens`` (``decision``: the
    cost model's, if the store was asked; None when it made none; ``damaged``: it
    skipped a snapshot whose blobs failed their checks, which the index alone cannot
    show).  A lookup that reused every token but the last is a hit without reading
    the index, unless the client asked to be told more."""
    n = len(tokens)
    if not wanted(n, cached, asked):
        return None
    e = store.explain(tokens, identity=identity, namespace=namespace, bounded=True)
    shared = max(cached, e.longest.shared if e.longest is not None else 0)
    usable = max(cached, e.best.usable if e.best is not None else 0)
    fields = e.longest.identity_fields if e.longest is not None else []

    def verdict(reason: str, **more: Any) -> Verdict:
        return Verdict(reason=reason, prompt=n, cached=cached, shared=shared, usable=usable, **more)

    if decision is not None and not decision.restore and cached < decision.tokens:
        cost = {"restore_s": decision.restore_s, "prefill_s": decision.prefill_s}
        return verdict("declined", cost=cost)
    if shared < HEAD_TOKENS:  # memory reuses a chat template's first tokens: no hit
        return verdict("empty")
    if cached >= min(shared, n - 1):
        return verdict("hit")
    if damaged:  # what the index offers, its blobs refused (attack r14)
        return verdict("damaged")
    reason = e.reason
    if reason == "declined":  # predicted so, but this lookup restored (or never asked)
        longest = e.longest.reason if e.longest is not None else "hit"
        reason = longest if longest != "declined" else "hit"
    return verdict(reason, fields=fields if reason == "identity" else [])


def wanted(n: int, cached: int, asked: bool) -> bool:
    """Does a lookup that reused ``cached`` of ``n`` tokens get a verdict?  Not a whole
    hit (every token but the last) that nobody asked about."""
    return asked or cached < n - 1


def judged(
    verdict: Callable[[], Verdict | None], misses: Counter | None, slot: ExplainSlot | None
) -> None:
    """Run ``verdict`` (a ``judge`` bound to its lookup), count one that is not a hit in
    ``misses`` and leave it in ``slot`` (a request that asked: logged too).  Never
    raises: a verdict is never worth a request."""
    try:
        v = verdict()
    except Exception as e:
        log.warning("persist: could not judge a lookup: %s", e)
        return
    if v is None:
        return
    if v.reason != "hit" and misses is not None:
        misses.labels(v.reason).inc()
    if slot is not None:
        slot.verdict = v
        told(v)


def told(v: Verdict) -> None:
    """The log line of a request that asked (no tenant, no text: counts and a code)."""
    log.info(
        "persist: explain: reason=%s prompt=%d cached=%d usable=%d shared=%d%s",
        v.reason, v.prompt, v.cached, v.usable, v.shared,
        f" fields={','.join(v.fields)}" if v.fields else "",
    )  # fmt: skip
