"""``GatedDeltaCache`` (kind ``gated-delta``): the recurrent state of one
gated-DeltaNet layer, as mlx-lm's qwen3_next linear-attention layers use it.

It is an ``ArraysCache`` of two slots (convolution state, recurrent state)
that also knows its own offset: the layer calls ``advance(S)`` after each
forward, and each row's offset grows by its real (unpadded) positions.  Its
state does not grow with the sequence (``bytes_per_token() == 0``) and can
never be trimmed.  A cache whose padded prefill is not finalized cannot be
persisted.

Speculative rounds: ``spec_round_begin()`` before the verify forward keeps
the pre-round state (free: MLX arrays are immutable) and arms the cache; the
layer (switched by ``make_cache`` to a recording subclass) hands its inputs
over during that forward.  ``spec_round_commit()`` keeps the full window;
``spec_round_rollback(keep)`` restores the snapshot and replays exactly the
first ``keep`` positions through the layer, so the state equals a run that
only ever saw the accepted tokens.  A cache with an armed round cannot be
persisted.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from ..errors import InvalidArgumentError, InvalidStateError

__all__ = ["GatedDeltaCache", "make_cache", "row_offset"]


def row_offset(offsets: Any) -> int:
    """The offset of a one-row ``offsets`` vector."""
    value: Any = offsets.item()
    return int(value)


class GatedDeltaCache(ArraysCache):
    def __init__(self, left_padding: list[int] | None = None) -> None:
        super().__init__(2, left_padding=left_padding)
        rows = len(left_padding) if left_padding else 1
        self.offsets = mx.zeros((rows,), dtype=mx.int32)
        self._round: dict[str, Any] | None = None

    # -- speculative rounds ---------------------------------------------------

    @property
    def round_armed(self) -> bool:
        return getattr(self, "_round", None) is not None

    def spec_round_begin(self) -> None:
        if self.round_armed:
            raise InvalidStateError("a speculative round is already armed")
        self._round = {"state": (list(self.cache), self.offsets), "layer": None}

    def record(self, layer: Any, inputs: Any, mask: Any) -> None:
        """Called by the layer during the verify forward of an armed round."""
        if self._round is not None:
            if self._round["layer"] is not None:
                raise InvalidStateError("at most one forward per armed speculative round")
            self._round.update(layer=layer, inputs=inputs, mask=mask)

    def spec_round_commit(self) -> None:
        if self._round is None:
            raise InvalidStateError("no speculative round is armed")
        self._round = None

    def spec_round_rollback(self, keep: int) -> None:
        """Restore the pre-round state and replay the first ``keep`` window positions."""
        r = self._round
        if r is None:
            raise InvalidStateError("no speculative round is armed")
        if r["layer"] is None:
            raise InvalidStateError("rollback before the verify forward of the round")
        window = r["inputs"].shape[1]
        if not 0 <= keep <= window:
            raise InvalidArgumentError(f"keep must be in [0, {window}], got {keep}")
        self._round = None
        self.cache, self.offsets = list(r["state"][0]), r["state"][1]
        if keep:
            mask = None if r["mask"] is None else r["mask"][..., :keep]
            replay = type(r["layer"]).__mro__[1].__call__  # the layer's own forward
            replay(r["layer"], r["inputs"][:, :keep], mask=mask, cache=self)
            mx.eval(self.cache)

    @property
    def offset(self) -> int:
        """Positions this cache covers (one row; a batch has ``offsets``)."""
        if self.offsets.size != 1:
            raise InvalidArgumentError(
                "a batch of several rows has one offset per row: use .offsets"
            )
        return row_offset(self.offsets)

    def advance(self, n: int) -> None:
        real = mx.full(self.offsets.shape, n, dtype=mx.int32)
        if self.lengths is not None:
            real = mx.minimum(real, mx.maximum(self.lengths, 0))
        if self.left_padding is not None:
            real = real - mx.clip(self.left_padding, 0, n)
        self.offsets = self.offsets + mx.maximum(real, 0).astype(mx.int32)
        super().advance(n)

    def bytes_per_token(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return False

    def padding_pending(self) -> bool:
        return self.left_padding is not None or self.lengths is not None

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        self.offsets = self.offsets[batch_indices]

    def extract(self, idx: int) -> GatedDeltaCache:
        c = GatedDeltaCache()
        c.cache = [x[idx : idx + 1] if x is not None else None for x in self.cache]
        c.offsets = self.offsets[idx : idx + 1]
        return c


_recording: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of a gated-DeltaNet layer that hands its inputs to an armed cache."""
    if cls not in _recording:

        def __call__(self: Any, inputs: Any, mask: Any = None, cache: Any = None) -> Any:
            if isinstance(cache, GatedDeltaCache) and cache.round_armed:
                cache.record(self, inputs, mask)
            return cls.__call__(self, inputs, mask=mask, cache=cache)

        # the identity digests it as ``cls`` (``provenance.SAME_AS``): its arithmetic is cls's
        body = {"__call__": __call__, "_persist_same_as": cls}
        _recording[cls] = type(f"Recording{cls.__name__}", (cls,), body)
    return _recording[cls]


def make_cache(model: Any, max_kv_size: int | None = None) -> list[Any]:
    """mlx-lm's ``make_prompt_cache``, with a GatedDeltaCache for each gated-DeltaNet layer.

    The layers are switched (once) to a recording subclass, so speculative
    rounds can replay accepted positions; their arithmetic is unchanged.
    """
    caches = make_prompt_cache(model, max_kv_size)
    for i, layer in enumerate(getattr(model, "layers", [])):
        if getattr(layer, "is_linear", False) and type(caches[i]) is ArraysCache:
            caches[i] = GatedDeltaCache()
            inner = getattr(layer, "linear_attn", None)
            if inner is not None and type(inner) not in _recording.values():
                inner.__class__ = _recording_class(type(inner))
    return caches
