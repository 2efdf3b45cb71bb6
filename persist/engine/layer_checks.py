"""What a save checks of a cache against its identity before anything is written.

The identity says which model computed the cache and how its caches are
configured; two facts of the cache itself can contradict it cheaply:

- the layer count (``identity.layers``, the model's own ``make_prompt_cache``);
- quantized layers.  A ``quantized-kv`` layer (mlx-lm's QuantizedKVCache,
  anywhere inside a wrapper or a CacheList) or a ``delayed-quantized``
  wrapper (which becomes one) is saved only under an identity whose
  ``kv_bits`` and ``kv_group_size`` are that layer's bits and group size: a
  plain lookup must never get quantized caches.  Plain KV layers under a
  kv_bits identity are fine while they hold fewer than its
  ``quantized_kv_start`` (S) positions: from S on, mlx-lm holds them
  quantized, so a plain layer (or a ring, which mlx-lm cannot quantize, or a
  ``delayed-quantized`` wrapper converting elsewhere than S) holding S or more
  is refused (``servable.plain_past_start``);
- where quantization began.  mlx-lm converts a cache once a forward leaves
  it holding ``quantized_kv_start`` (S) positions or more
  (``maybe_quantize_kv_cache``: ``offset >= S``), so under an identity that
  names S, a layer quantized from fewer positions (a ``quantized-kv``
  record's floor, ``min_resume_offset``; a ``delayed-quantized`` wrapper's
  ``converted_at``) is a state no fresh run has: refused.  Its snapshots
  serve no prefix of S tokens or fewer (``servable.kv_bits_floor``).
- rings.  Every ring (``rotating-kv``, ``batch-rotating-kv``, anywhere in a
  layer's tree), and every layer without one, must be what the identity's
  model makes under its ``max_kv_size`` (``ModelIdentity.windows``: a model's
  own sliding-window layers, or ``--max-kv-size`` rings of keep 4): a ring
  handed to a user whose caches attend to every position (or to another
  window) continues differently once it wraps.  An identity that records no
  windows (made by hand, or by a persist before them) makes no claim.

Checked on the captured records (``Snapshot.records``), so a snapshot handed
to ``Store.save`` is checked as a live cache list is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import IdentityMismatchError, InvalidArgumentError
from ..identity import ModelIdentity
from ..kinds import parse_kind
from ..records import Record
from ..servable import plain_past_start

__all__ = [
    "check_layers",
    "check_windows",
    "check_quantized",
    "refuse_quantized",
    "refuse_early",
    "refuse_plain_past_start",
    "refuse_quantized_rings",
    "quantized_start",
    "holds_quantized",
    "QUANTIZING_KINDS",
]

QUANTIZING_KINDS = ("quantized-kv", "delayed-quantized")
RING_KINDS = ("rotating-kv", "batch-rotating-kv")
MLX_LM_GROUP_SIZE = 64  # kv_group_size when an identity with kv_bits names none


def check_layers(cache: Any, identity: ModelIdentity) -> None:
    """A cache list of another length than the identity's model makes was computed
    by another model: refused before anything is written (a draft's caches ride
    in the same list, so identities with a draft are not checked)."""
    from ..codecs.snapshot import Snapshot

    if not isinstance(cache, (Snapshot, list, tuple)):
        return  # not a cache list at all: capture refuses it (UnsupportedCacheError)
    n = len(cache.records) if isinstance(cache, Snapshot) else len(cache)
    if identity.layers and not identity.draft and n != identity.layers:
        raise IdentityMismatchError(
            "this cache",
            ["layers"],
            f"{n} layers",
            f"{identity.display()}, whose caches have {identity.layers} layers",
        )


def check_windows(records: Sequence[Record], identity: ModelIdentity) -> None:
    """Refuse a layer whose rings (window, keep) are not those the identity's model
    makes under its max_kv_size.  With a draft only the model's own layers are
    compared (the draft's layout is its own)."""
    if identity.windows is None:
        return
    upto = identity.layers if identity.draft else len(records)
    for i, record in enumerate(records[:upto]):
        got = list(_rings(record))
        want = [(size, keep) for layer, size, keep in identity.windows if layer == i]
        if got != want:
            window = dict(identity.cache_config).get("max_kv_size")
            raise IdentityMismatchError(
                "this cache",
                ["max_kv_size"],
                f"layer {i} {_show_rings(got)}",
                f"{identity.display()} with max_kv_size={window}, "
                f"whose layer {i} {_show_rings(want)}",
            )


def _rings(record: Record) -> Iterator[tuple[int, int]]:
    """(max_size, keep) of every ring in ``record``'s tree, in order."""
    if parse_kind(record.kind).name in RING_KINDS:
        yield int(record.meta.get("max_size", 0)), int(record.meta.get("keep", 0))
    for child in record.children:
        yield from _rings(child)


def _show_rings(rings: list[tuple[int, int]]) -> str:
    if not rings:
        return "holds no ring (every position attended to)"
    return "is a ring of " + ", ".join(f"{size} positions (keep {keep})" for size, keep in rings)


def check_quantized(records: Sequence[Record], identity: ModelIdentity) -> None:
    """Refuse any quantized layer whose bits and group size are not the identity's,
    or that was quantized before the identity's ``quantized_kv_start``."""
    for i, record in enumerate(records):
        for kind, bits, group, floor in _quantized(record):
            refuse_quantized(f"layer {i} ({kind})", bits, group, identity, "this cache")
            refuse_early(f"layer {i} ({kind})", floor, identity, "this cache")
    n = max((_offset(r) for r in records), default=0)  # recurrent layers hold none
    refuse_plain_past_start(records, n, identity, "this cache")


def refuse_quantized_rings(identity: ModelIdentity) -> None:
    """InvalidArgumentError for kv_bits on a model whose caches hold rings (its own
    sliding-window layers, or max_kv_size): mlx-lm cannot quantize a ring, and
    fails once a prompt reaches quantized_kv_start.  Said before anything runs."""
    cfg = dict(identity.cache_config)
    if cfg.get("kv_bits") is None or not identity.windows:
        return
    layer, size, keep = identity.windows[0]
    raise InvalidArgumentError(
        f"kv_bits={cfg['kv_bits']} cannot be used with {identity.display()}: its layer "
        f"{layer} is a ring of {size} positions (keep {keep}; a sliding window or "
        "max_kv_size), and mlx-lm cannot quantize rings (RotatingKVCache); drop kv_bits"
        + (" or max_kv_size" if cfg.get("max_kv_size") is not None else "")
    )


def _offset(record: Record) -> int:
    """The positions a layer's record covers (a wrapper's: its inner record's)."""
    off = record.meta.get("offset")
    if type(off) is int:
        return off
    return max((_offset(c) for c in record.children), default=0)


def refuse_plain_past_start(
    layers: Sequence[Any], n: int, identity: ModelIdentity, where: str
) -> None:
    """IdentityMismatchError when a state of ``n`` positions holds a layer still
    plain where mlx-lm, under the identity's kv_bits, holds it quantized."""
    start = quantized_start(identity)
    why = plain_past_start(layers, n, start)
    if why is None:
        return
    cfg = dict(identity.cache_config)
    raise IdentityMismatchError(
        where,
        ["quantized_kv_start"],
        why,
        f"{identity.display()} with kv_bits={cfg.get('kv_bits')}, quantized_kv_start={start}, "
        "from which mlx-lm holds caches quantized",
    )


def quantized_start(identity: ModelIdentity) -> int | None:
    """The identity's quantized_kv_start, when it quantizes (kv_bits) and names one.
    An identity naming none makes no claim on where quantization began."""
    cfg = dict(identity.cache_config)
    return cfg.get("quantized_kv_start") if cfg.get("kv_bits") is not None else None


def holds_quantized(records: Sequence[Record]) -> bool:
    """Any quantized layer (a converted delayed wrapper holds one) anywhere in ``records``."""
    return any(kind == "quantized-kv" for r in records for kind, *_ in _quantized(r))


def refuse_early(layer: str, floor: int | None, identity: ModelIdentity, where: str) -> None:
    """IdentityMismatchError when ``layer`` was quantized from ``floor`` positions,
    fewer than the identity's quantized_kv_start (``floor`` None: not quantized yet)."""
    start = quantized_start(identity)
    if start is None or floor is None or floor >= start:
        return
    raise IdentityMismatchError(
        where,
        ["quantized_kv_start"],
        f"{layer} quantized from {floor} positions",
        f"{identity.display()} with quantized_kv_start={start}, below which mlx-lm "
        "keeps caches plain",
    )


def refuse_quantized(
    layer: str, bits: Any, group: Any, identity: ModelIdentity, where: str
) -> None:
    """IdentityMismatchError unless (bits, group) are the identity's kv_bits and
    kv_group_size (mlx-lm's default group size when it names none)."""
    cfg = dict(identity.cache_config)
    bits_of = cfg.get("kv_bits")
    want = (bits_of, cfg.get("kv_group_size", MLX_LM_GROUP_SIZE)) if bits_of is not None else None
    if (bits, group) == want:
        return
    raise IdentityMismatchError(
        where,
        ["kv_bits", "kv_group_size"],
        f"{layer} quantized with kv_bits={bits}, kv_group_size={group}",
        f"{identity.display()} with kv_bits={bits_of}, kv_group_size={cfg.get('kv_group_size')}",
    )


def _quantized(record: Record) -> Iterator[tuple[str, Any, Any, int | None]]:
    """(kind, bits, group size, offset quantized from) of every quantizing record in
    ``record``'s tree: a quantized-kv's floor, a delayed wrapper's conversion point."""
    name = parse_kind(record.kind).name
    if name in QUANTIZING_KINDS:
        key = "min_resume_offset" if name == "quantized-kv" else "converted_at"
        floor = record.meta.get(key)
        yield name, record.meta.get("bits"), record.meta.get("group_size"), floor
    for child in record.children:
        yield from _quantized(child)
