"""Route caches and records to their codecs through the kind registry."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import NotResumableError, UnsupportedVersionError
from ..kinds import class_for, codec_for, kind_of, require_known
from ..records import Record, RecordSpec, ResumeFacts
from ..servable import holds_quantized, kv_bits_floor, of_record, plain_past_start
from .base import invalid

__all__ = [
    "encode_cache",
    "check_spec",
    "decode_record",
    "facts_of",
    "trim_record",
    "capacity_of",
    "serves_itself",
    "cut_clean",
]


def encode_cache(cache: Any) -> Record:
    kind = kind_of(cache)
    return codec_for(kind).encode(cache, kind)


def facts_of(cache: Any) -> ResumeFacts:
    """A codec's facts; a kind whose codec cannot trim a record is never trimmable."""
    codec = codec_for(kind_of(cache))
    facts = codec.facts(cache)
    if facts.trimmable and not callable(getattr(codec, "trim", None)):
        facts = dataclasses.replace(facts, trimmable=False)
    return facts


def serves_itself(cache: Any, kv_start: int | None = None) -> bool:
    """Is every layer of a live cache list a state its kind's rule serves at its own
    length?  A cut made outside persist (mlx-lm's ``trim_prompt_cache`` in its
    server's prompt cache) may leave one no fresh prefill gives.  ``kv_start``:
    the identity's quantized_kv_start (kv_bits), below which a fresh run is plain
    and from which it is quantized."""
    records, facts_all = [encode_cache(c) for c in cache], [facts_of(c) for c in cache]
    n = max((f.offset for f in facts_all if f.offset is not None), default=0)
    if plain_past_start(records, n, kv_start) is not None:  # mlx-lm holds these quantized
        return False
    for rec, facts in zip(records, facts_all, strict=True):
        if facts.offset is None:
            continue
        rule = of_record(rec)
        floor = max(rule.floor if rule is not None else 0, facts.min_resume_offset)
        if kv_bits_floor(floor, holds_quantized(rec), kv_start) > facts.offset:
            return False
    return True


def cut_clean(cache: list[Any]) -> list[Any]:
    """``cache`` with every layer a cache class's own trim left holding the positions
    it cut (mlx-lm's ``ConcatenateKVCache.trim``, which its server's prompt cache
    uses) rebuilt from its record: live data only, as persist's own cut keeps it."""
    out = []
    for c in cache:
        hides = getattr(codec_for(kind_of(c)), "hides_positions", None)
        out.append(decode_record(encode_cache(c)) if hides is not None and hides(c) else c)
    return out


def trim_record(record: Record, n: int) -> Record:
    """The record a fresh prefill of the first ``n`` positions would have produced.

    Trimming happens here, on records, never through a cache class's own
    ``trim`` (mlx-lm's ConcatenateKVCache.trim only lowers ``offset`` and keeps
    the cut positions, which the next update would attend to).
    """
    trim = getattr(codec_for(record.kind), "trim", None)
    if trim is None:
        raise NotResumableError(f"{record.kind}: this kind cannot be trimmed")
    rule = of_record(record)  # the one rule of what a cut may keep (persist.servable)
    if rule is not None and not (rule.trimmable and rule.floor <= n):
        raise NotResumableError(
            f"{record.kind}: a cut to {n} positions is not a state a fresh prefill gives"
            f" (this state serves cuts from {rule.floor} on)"
            if rule.trimmable
            else f"{record.kind}: this state serves only its own length"
        )
    out: Record = trim(record, n)
    return out


def check_spec(spec: RecordSpec) -> None:
    """Refuse a record (and its inner records) before anything is allocated."""
    node = require_known(spec.kind)
    codec = codec_for(node.name)
    if type(spec.version) is not int or spec.version < 1:
        raise invalid(spec, f"codec version {spec.version!r} is not a positive integer")
    if spec.version > codec.version:
        raise UnsupportedVersionError(spec.kind, spec.version, codec.version)
    for child in spec.children:
        require_known(child.kind)  # unknown anywhere is UnknownKindError, first
    inner = tuple(str(a) for a in node.args)
    if inner != tuple(c.kind for c in spec.children):
        raise invalid(spec, "inner records do not match the inner kinds")
    for child in spec.children:
        check_spec(child)
    codec.check(spec)


def decode_record(record: Record) -> Any:
    """Build a live cache from a record that ``check_spec`` accepted."""
    return codec_for(record.kind).decode(record, class_for(record.kind))


def capacity_of(spec: RecordSpec) -> dict[str, int]:
    """Token-axis room per tensor, from the codec's optional ``capacity`` hook."""
    hook = getattr(codec_for(spec.kind), "capacity", None)
    return dict(hook(spec, class_for(spec.kind))) if hook is not None else {}
