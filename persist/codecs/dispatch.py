"""Route caches and records to their codecs through the kind registry."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedVersionError
from ..kinds import class_for, codec_for, kind_of, require_known
from ..records import Record, RecordSpec, ResumeFacts
from .base import invalid

__all__ = ["encode_cache", "check_spec", "decode_record", "facts_of"]


def encode_cache(cache: Any) -> Record:
    kind = kind_of(cache)
    return codec_for(kind).encode(cache, kind)


def facts_of(cache: Any) -> ResumeFacts:
    return codec_for(kind_of(cache)).facts(cache)


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
