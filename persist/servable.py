"""Which prefix lengths a layer's saved state can serve: one pure rule per cache kind.

Each rule reads only what the layer's record states (its meta, and the
answers of its inner records), so a save (the index's ``trimmable`` and
``min_resume`` columns), a codec's trim, a lookup's confirmation of a row, a
repair, an import and a tier pull all answer the question the same way.  A
cut to ``n`` positions is served when it gives exactly the state a fresh
prefill of those ``n`` tokens (fed the same chunks) would continue from.
docs/FORMAT.md section "Servable prefixes" states every rule.  No mlx here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "Servable",
    "EXACT",
    "ANY",
    "RULES",
    "intersect",
    "kv_bits_floor",
    "holds_quantized",
    "plain_past_start",
    "CONVERTIBLE_KINDS",
    "of_record",
    "of_layers",
    "of_manifest",
    "of_row",
    "plain_reason",
]


@dataclass(frozen=True)
class Servable:
    """A state of ``length`` positions serves ``length`` itself and, when
    ``trimmable``, every length in [``floor``, ``length``]; never below ``floor``,
    and with ``below`` set never ``below`` or more (layers a kv_bits identity holds
    quantized from there on, still plain: ``of_row``'s ``quantized_start``)."""

    trimmable: bool
    floor: int
    below: int | None = None

    def serves(self, n: int, length: int) -> bool:
        """May a state of ``length`` positions be cut to (or kept at) ``n``?"""
        if self.below is not None and n >= self.below:
            return False
        return 0 < n <= length and self.floor <= n and (n == length or self.trimmable)


EXACT = Servable(False, 0)  # only the saved length (recurrent state: no positions to cut)
ANY = Servable(True, 0)  # any prefix (a plain growing KV cache)


def intersect(parts: Iterable[Servable]) -> Servable:
    """What every part serves: a wrapper, a cache list, a whole snapshot."""
    got = list(parts)
    ceilings = [p.below for p in got if p.below is not None]
    return Servable(
        all(p.trimmable for p in got),
        max((p.floor for p in got), default=0),
        min(ceilings) if ceilings else None,
    )


def _int(meta: Mapping[str, Any], key: str, default: int = 0) -> int:
    v = meta.get(key, default)
    return v if type(v) is int else default


def chunked(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    """``chunked-kv`` holds positions [start_position, offset).  Kept at (or cut to) n,
    it continues like a fresh prefill of n tokens only if mlx-lm's next front drop
    (which keeps the last chunk_size positions) leaves both holding the same
    positions: nothing was dropped (start 0), or n >= start_position + chunk_size.
    Below, a position attends to chunk positions the state no longer holds.  A
    state whose front was dropped never holds fewer than chunk_size positions
    (the drop keeps chunk_size, then the call adds more), unless something cut it
    (mlx-lm's own trim of a live cache): such a state serves nothing, itself
    included."""
    start, chunk = _int(meta, "start_position"), max(1, _int(meta, "chunk_size", 1))
    return ANY if start == 0 else Servable(True, start + chunk)


def rotating(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    """``rotating-kv``: a ring that never wrapped (write index = offset < max_size)
    holds every position in order and cuts anywhere; a wrapped one (or a long
    prefill's oversized buffer) lost positions and keeps its ``keep`` head in
    ring order, so it serves only its own length."""
    offset, idx = _int(meta, "offset"), _int(meta, "idx", -1)
    return ANY if offset == idx and offset < _int(meta, "max_size") else EXACT


def quantized(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    """``quantized-kv``: positions below the conversion point were quantized at
    once; a cut below ``min_resume_offset`` is a state no fresh run holds.  A
    record never holds fewer positions than that (its codec checks it); a live
    cache cut below it outside persist (mlx-lm's ``trim_prompt_cache`` in its
    server's prompt cache) does, and serves nothing, itself included."""
    return Servable(True, _int(meta, "min_resume_offset"))


def kv_bits_floor(floor: int, quantized: bool, start: int | None) -> int:
    """The floor of a state holding ``quantized`` layers under an identity whose
    caches mlx-lm quantizes from ``start`` positions on (kv_bits,
    quantized_kv_start): it serves no prefix of ``start`` tokens or fewer, where
    a fresh run's caches are still plain.  ``start`` None (no kv_bits, or no start
    named) changes nothing."""
    if quantized and start is not None:
        return max(floor, start + 1)
    return floor


# kinds whose mlx-lm class has ``to_quantized``: ``maybe_quantize_kv_cache`` converts
# a top-level layer of these once it holds quantized_kv_start positions (rings raise)
CONVERTIBLE_KINDS = ("kv", "rotating-kv", "batch-rotating-kv")


def plain_past_start(layers: Sequence[Any], n: int, start: int | None) -> str | None:
    """Why a state of ``n`` positions whose top-level ``layers`` (records or layer
    maps: kind, meta) is one no fresh run holds under an identity whose caches
    mlx-lm quantizes from ``start`` positions on, or None.  mlx-lm converts every
    convertible layer after any forward that leaves it holding ``start`` or more,
    so such a layer still plain at ``n >= start`` is no fresh run's; nor is a
    ``delayed-quantized`` wrapper converting at another point than ``start`` (its
    conversion and mlx-lm's differ once a forward ends between the two)."""
    if start is None or n < start:
        return None
    for i, layer in enumerate(layers):
        kind = layer.kind if hasattr(layer, "kind") else str(layer.get("kind", ""))
        meta = layer.meta if hasattr(layer, "meta") else layer.get("meta") or {}
        base = _base(kind)
        if base in CONVERTIBLE_KINDS:
            return f"layer {i} ({base}) holds {n} positions unquantized"
        if base == "delayed-quantized" and meta.get("start") != start:
            return f"layer {i} (delayed-quantized) converts at {meta.get('start')}"
    return None


def holds_quantized(rec: Any) -> bool:
    """Is a quantized layer anywhere in a record's tree (a converted wrapper's too)?"""
    return _base(rec.kind) == "quantized-kv" or any(holds_quantized(c) for c in rec.children)


def batch_rotating(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    """``batch-rotating-kv``: as a ring, cut only before it turned."""
    turned = meta.get("rotated") is not False
    return EXACT if turned or _int(meta, "position") >= _int(meta, "max_size") else ANY


def delayed(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    """``delayed-quantized``: its inner cache's set, never below the conversion."""
    converted = meta.get("converted_at")
    floor = converted if type(converted) is int else 0
    return intersect([*inner, Servable(True, floor)])


def every_part(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    """``cache-list``: what every inner cache serves."""
    return intersect(inner)


def _any(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    return ANY


def _exact(meta: Mapping[str, Any], inner: Sequence[Servable] = ()) -> Servable:
    return EXACT


Rule = Callable[[Mapping[str, Any], Sequence[Servable]], Servable]

# base kind name -> its rule (a kind's arguments name its inner records)
RULES: dict[str, Rule] = {
    "kv": _any,
    "concat-kv": _any,
    "batch-kv": _any,
    "chunked-kv": chunked,
    "rotating-kv": rotating,
    "batch-rotating-kv": batch_rotating,
    "quantized-kv": quantized,
    "arrays": _exact,  # recurrent state: only its exact checkpoint
    "gated-delta": _exact,
    "deepseek-v4-layer": _exact,  # compressed groups: see codecs/deepseek.py
    "delayed-quantized": delayed,
    "cache-list": every_part,
}


def _base(kind: str) -> str:
    return kind.split("(", 1)[0]


def of_record(rec: Any) -> Servable | None:
    """The set a record (``Record`` or ``RecordSpec``: kind, meta, children) serves;
    None for a kind without a built-in rule (a registered codec's own facts decide)."""
    rule = RULES.get(_base(rec.kind))
    if rule is None:
        return None
    inner = [of_record(c) for c in rec.children]
    if any(s is None for s in inner):
        return None
    return rule(rec.meta, [s for s in inner if s is not None])


def of_layers(layers: Sequence[Mapping[str, Any]]) -> Servable | None:
    """The set a snapshot serves, from its manifest's layer maps (kind, meta, children)."""

    class _Map:
        def __init__(self, m: Mapping[str, Any]) -> None:
            self.kind = str(m.get("kind", ""))
            meta = m.get("meta")
            self.meta = meta if isinstance(meta, Mapping) else {}
            self.children = [_Map(c) for c in m.get("children") or () if isinstance(c, Mapping)]

    found = [of_record(_Map(m)) for m in layers]
    if any(s is None for s in found):
        return None
    return intersect(s for s in found if s is not None)


def _layers(manifest: bytes) -> list[Mapping[str, Any]] | None:
    try:
        layers = msgpack.unpackb(manifest, raw=False)["layers"]
    except Exception:
        return None
    return [m for m in layers if isinstance(m, Mapping)] if isinstance(layers, list) else None


def of_manifest(manifest: bytes) -> Servable | None:
    """The set a stored snapshot's manifest (its layers' records) serves; None when
    the manifest names a kind without a rule or cannot be read (check reports it)."""
    layers = _layers(manifest)
    return None if layers is None else of_layers(layers)


def of_row(
    trimmable: bool, floor: int, manifest: bytes, quantized_start: int | None = None
) -> Servable:
    """A stored row's set: its columns (written by the rules at save, plus what the
    identity and unverified tokens add) narrowed by the rules over its manifest, so a
    row saved before a rule was tightened (or pulled from an older peer) serves no
    cut the rules refuse today.  ``quantized_start``: the looking identity's
    quantized_kv_start when it has kv_bits (``layer_checks.quantized_start``); a row
    whose layers are plain there (``plain_past_start``, saved by an older persist)
    serves no cut of that many positions or more."""
    stored = Servable(trimmable, floor)
    ruled = of_manifest(manifest)
    got = stored if ruled is None else intersect([stored, ruled])
    if quantized_start is not None and plain_reason(manifest, quantized_start) is not None:
        got = intersect([got, Servable(True, 0, quantized_start)])
    return got


def plain_reason(manifest: bytes, quantized_start: int) -> str | None:
    """Why a row's layers are no fresh run's once cut to ``quantized_start`` positions
    or more (``plain_past_start``), or None: what explain tells."""
    layers = _layers(manifest)
    return None if layers is None else plain_past_start(layers, quantized_start, quantized_start)
