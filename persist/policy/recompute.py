"""Restore or recompute: pure rules over measured rates (no disk, no mlx).

Predicted restore and prefill seconds from per-bucket samples, and the
decision to take a hit or prefill its tokens again (``decide_cost``);
``engine.costs`` feeds them what ``storage.rates`` measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "rate_bucket",
    "prefill_seconds",
    "restore_seconds",
    "RateEstimate",
    "rate_of",
    "restore_estimate",
    "RestoreEstimate",
    "floor_seconds",
    "FASTER_THAN",
    "CostDecision",
    "decide_cost",
]

# Rates are measured on real restores (bytes/s, per tier) and real prefills
# (tokens/s, per context length) and kept per power of two of the amount:
# restores have a fixed cost that small ones feel, and a token's prefill cost
# grows with the context before it (attention).


def rate_bucket(amount: int) -> int:
    """The bucket a measurement of ``amount`` (bytes, or a context position) falls in:
    positions [2**(b-1), 2**b) are bucket b; 0 is bucket 0."""
    return max(0, int(amount)).bit_length()


def _rate_near(rates: Mapping[int, float], b: int) -> float | None:
    """The rate of bucket ``b``, else of the nearest measured one (the lower on a tie)."""
    good = [k for k, r in rates.items() if r > 0]
    if not good:
        return None
    return rates[min(good, key=lambda k: (abs(k - b), k))]


def prefill_seconds(rates: Mapping[int, float], start: int, end: int) -> float | None:
    """Predicted seconds to prefill positions [start, end) after ``start`` cached ones:
    the per-bucket tokens/s integrated over the positions; None before any measurement."""
    if _rate_near(rates, 0) is None:
        return None
    total, pos = 0.0, max(0, start)
    while pos < end:
        b = rate_bucket(pos)
        stop = min(end, 1 << b)  # the first position of the next bucket
        rate = _rate_near(rates, b)
        assert rate is not None
        total += (stop - pos) / rate
        pos = stop
    return total


def restore_seconds(rates: Mapping[int, float], nbytes: int) -> float | None:
    """Predicted seconds to restore ``nbytes`` at the measured bytes/s; None unmeasured."""
    rate = _rate_near(rates, rate_bucket(nbytes))
    return None if rate is None else nbytes / rate


# A rate is read from the latest few samples of its bucket, never from one: the
# median is the estimate, the upper quartile the optimistic end of it, and a hit
# is declined only on MIN_SAMPLES or more (one run slowed by load declined every
# later hit of a bucket, for good: issue 39).
MIN_SAMPLES = 3  # samples before an estimate may decline a hit
KEEP_SAMPLES = 5  # the latest samples a bucket keeps (two fast runs outvote old slow ones)


@dataclass(frozen=True)
class RateEstimate:
    """What the samples of a bucket say: the median rate, the upper quartile (the
    optimistic end) and how many samples stand behind them."""

    typical: float
    best: float
    samples: int


def rate_of(samples: Sequence[float]) -> RateEstimate | None:
    """The estimate from ``samples`` (rates per second; non-positive ones ignored)."""
    good = sorted(r for r in samples if r > 0)
    if not good:
        return None
    n = len(good)
    mid = good[n // 2] if n % 2 else (good[n // 2 - 1] + good[n // 2]) / 2
    best = good[min(n - 1, -(-3 * n // 4) - 1)]  # nearest rank of the 75th percentile
    return RateEstimate(mid, max(best, mid), n)


@dataclass(frozen=True)
class RestoreEstimate:
    """Predicted seconds of a restore (``seconds``), its optimistic end (``best``)
    and the samples behind it."""

    seconds: float
    best: float
    samples: int


def restore_estimate(samples: Mapping[int, Sequence[float]], nbytes: int) -> RestoreEstimate | None:
    """Seconds to restore ``nbytes`` from per-bucket samples of bytes/s; None unmeasured.

    A bucket of fewer than MIN_SAMPLES borrows its neighbours' samples; a bucket
    never measured takes the nearest one's.  ``samples`` counts only those of its
    bucket or larger ones: a smaller restore's rate understates a larger one's (at
    10 KiB, 2-13 MB/s; at 1.5 MB, 110-200 MB/s), so it never declines a hit.  A
    larger bucket's confident estimate bounds this one from above: restoring fewer
    bytes never takes longer than the fewest bytes of that bucket did (restores of
    the next bucket up were 22x faster while one slow sample here declined every
    hit)."""
    measured = [k for k, s in samples.items() if any(r > 0 for r in s)]
    if not measured:
        return None
    b = rate_bucket(nbytes)
    used = [b] if len(samples.get(b, ())) >= MIN_SAMPLES else [b - 1, b, b + 1]
    est = rate_of([r for k in used for r in samples.get(k, ())])
    if est is None:  # the nearest measured bucket's
        used = [min(measured, key=lambda k: (abs(k - b), k))]
        est = rate_of(samples[used[0]])
    assert est is not None
    # a smaller restore's rate may understate this one's (its fixed costs are spread
    # over fewer bytes): it prices, it never makes the estimate confident
    behind = sum(1 for k in used if k >= b for r in samples.get(k, ()) if r > 0)
    seconds, best = nbytes / est.typical, nbytes / est.best
    for k in measured:
        above = rate_of(samples[k]) if k > b else None
        if above is not None and above.samples >= MIN_SAMPLES:
            lo = 1 << (k - 1)  # the fewest bytes of bucket k: more than nbytes
            seconds, best = min(seconds, lo / above.typical), min(best, lo / above.best)
    return RestoreEstimate(seconds, min(best, seconds), behind)


# Tiers whose restores are never slower than a tier's own: the host tier's bytes are
# in RAM already; the store's files in the page cache ("local") are read without the
# disk ("local-disk"); a fleet tier (any other name) brings its bytes to this store first.
FASTER_THAN: dict[str, tuple[str, ...]] = {
    "host": (),
    "local": ("host",),
    "local-disk": ("host", "local"),
}
FLEET_FASTER = ("host", "local")


def floor_seconds(
    tiers: Mapping[str, Mapping[int, Sequence[float]]], nbytes: int, tier: str
) -> float | None:
    """The fewest seconds a restore of ``nbytes`` from ``tier`` could take here (None:
    unknown): at the fastest optimistic rate (upper quartile) of a bucket of
    MIN_SAMPLES or more samples, no smaller than ``nbytes``'s, of a tier never slower
    than ``tier`` (FASTER_THAN).  A larger restore's rate is no slower (its fixed costs
    are shared by more bytes); a smaller bucket's rate could understate it, and a
    slower tier's could too, so none of those is asked."""
    b = rate_bucket(nbytes)
    fastest = 0.0
    for name in FASTER_THAN.get(tier, FLEET_FASTER):
        for k, got in tiers.get(name, {}).items():
            est = rate_of(got) if k >= b else None
            if est is not None and est.samples >= MIN_SAMPLES:
                fastest = max(fastest, est.best)
    return nbytes / fastest if fastest > 0 else None


Reason = Literal[
    "unmeasured", "faster", "slower", "max_cost", "learning", "uncertain", "explore", "bound"
]


@dataclass(frozen=True, kw_only=True)
class CostDecision:
    """Restore a hit of ``tokens`` tokens (``nbytes`` to read), or prefill them again.

    ``restore_s`` is the predicted restore (the median rate), ``best_s`` its
    optimistic end (the upper quartile rate) and ``samples`` the measurements
    behind it: the decision's confidence.  ``held``: the tokens the caller holds
    already (mlx-lm's memory); ``prefill_s`` prices positions [held, tokens), what
    the caller computes when it declines."""

    tokens: int
    nbytes: int
    tier: str  # where the bytes are: "host" (RAM), "local", "shared", "cold"
    restore_s: float | None  # predicted; None: never measured here
    prefill_s: float | None
    restore: bool
    reason: Reason
    best_s: float | None = None
    samples: int | None = None  # None: as many as confidence needs
    held: int = 0  # tokens held already: the declined hit's prefill starts there
    floor_s: float | None = None  # the fastest it could restore here (``floor_seconds``)


def decide_cost(
    tokens: int,
    nbytes: int,
    tier: str,
    *,
    restore_s: float | None,
    prefill_s: float | None,
    max_cost: float | None = None,
    best_s: float | None = None,
    samples: int | None = None,
    explore: bool = False,
    held: int = 0,
    floor_s: float | None = None,
) -> CostDecision:
    """Take a hit unless restoring it is confidently predicted to lose to a prefill.

    ``prefill_s`` prices what the caller computes instead: the hit's tokens past the
    ``held`` it already has (a restore of 7,241 tokens lost to mlx-lm's memory of
    7,073 and a prefill of 168 while it was priced against all 7,241).
    ``max_cost`` (seconds) replaces the predicted prefill as a hard limit (no
    learning, no exploring past it).  Before anything was measured a hit is
    restored: persist's behaviour without a model.  Against a prefill, a hit
    predicted slower is still restored (and so measured again) while fewer than
    MIN_SAMPLES stand behind the estimate ("learning"), while its optimistic end
    ``best_s`` beats the prefill ("uncertain"), or when the caller says an
    exploration is due ("explore": a wrong estimate corrects itself).  Unmeasured
    or learning, a hit that loses to the prefill even at ``floor_s`` (the fastest any
    tier confidently restores here: ``floor_seconds``) is declined ("bound"): there is
    nothing to learn that could make it win.
    """

    def out(ok: bool, reason: Reason) -> CostDecision:
        return CostDecision(
            tokens=tokens,
            nbytes=nbytes,
            tier=tier,
            restore_s=restore_s,
            prefill_s=prefill_s,
            restore=ok,
            reason=reason,
            best_s=best_s,
            samples=samples,
            held=held,
            floor_s=floor_s,
        )

    def unless_bound(reason: Reason) -> CostDecision:
        if floor_s is not None and prefill_s is not None and floor_s > prefill_s:
            return out(False, "bound")
        return out(True, reason)

    if restore_s is None or (prefill_s is None and max_cost is None):
        return out(True, "unmeasured") if max_cost is not None else unless_bound("unmeasured")
    if max_cost is not None:
        return out(restore_s <= max_cost, "max_cost")
    assert prefill_s is not None
    if restore_s < prefill_s:
        return out(True, "faster")
    if samples is not None and samples < MIN_SAMPLES:
        return unless_bound("learning")
    if best_s is not None and best_s < prefill_s:
        return out(True, "uncertain")
    return out(True, "explore") if explore else out(False, "slower")
