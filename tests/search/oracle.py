"""The search's oracle: a fresh cache fed a hit's own tokens in the session's chunks.

MLX on CPU is not chunk-invariant, so the reference for a hit of ``k`` tokens
is the session's own chunks cut at ``k``.  A session run with kv_bits
(``Quant``) converts its KV layers to QuantizedKVCache after the first call
that ends at ``quantized_kv_start`` or more, as mlx-lm's ``generate_step``
does (``maybe_quantize_kv_cache``), and so does the reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import (
    ChunkedKVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from persist.codecs import encode_cache
from tests.helpers import assert_same_state, live_state, raw


@dataclass(frozen=True)
class Quant:
    """mlx-lm's kv_bits settings for a session."""

    bits: int
    group: int
    start: int

    def convert(self, cache: list[Any]) -> None:
        """mlx-lm's conversion of every KV layer holding ``start`` positions or more."""
        maybe_quantize_kv_cache(cache, self.start, self.group, self.bits)

    def identity(self) -> dict[str, int]:
        """The cache_config a ModelIdentity of such a session names."""
        return {"kv_bits": self.bits, "kv_group_size": self.group, "quantized_kv_start": self.start}


def quantized(cache: Sequence[Any]) -> bool:
    return any(isinstance(c, QuantizedKVCache) for c in cache)


def feed(
    model: Any,
    chunks: Sequence[Sequence[int]],
    cache: list[Any] | None = None,
    quant: Quant | None = None,
) -> list[Any]:
    """A cache fed ``chunks``, one call each (a fresh one unless ``cache`` is given),
    each call followed by mlx-lm's kv_bits conversion when ``quant`` is given."""
    cache = make_prompt_cache(model) if cache is None else cache
    for c in chunks:
        model(mx.array([list(c)]), cache=cache)
        if quant is not None:
            quant.convert(cache)
        mx.eval([x.state for x in cache])
    return cache


def replay(
    model: Any,
    calls: Sequence[tuple[Sequence[int], Sequence[int]]],
    k: int,
    quant: Quant | None = None,
) -> list[Any]:
    """The session's own calls replayed up to ``k`` tokens: each call fed whole, its
    rejected drafts included, converted (kv_bits) and rolled back as the session
    was, and the call holding position ``k`` cut there by mlx-lm's trim.  The
    reference for models whose forward gives a position other bits when other
    tokens share its call (``calls_are_exact``)."""
    cache, n = make_prompt_cache(model), 0
    for accepted, drafts in calls:
        if n >= k:
            break
        model(mx.array([[*accepted, *drafts]]), cache=cache)
        if quant is not None:
            quant.convert(cache)
        cut = len(drafts) + max(0, n + len(accepted) - k)
        assert trim_prompt_cache(cache, cut) == cut
        n = min(n + len(accepted), k)
        mx.eval([x.state for x in cache])
    return cache


def calls_are_exact(model: Any, vocab: int) -> bool:
    """Does a position get the same bits whatever else shares its call?  Not for
    DeepSeek-style latent attention (one token takes another path than two) or
    phi3small's block-sparse attention, among others."""
    rng = random.Random(1)
    for pre, n in ((0, 8), (5, 2), (3, 24)):
        head, toks = ([rng.randrange(vocab) for _ in range(m)] for m in (pre, n))
        a, b = make_prompt_cache(model), make_prompt_cache(model)
        if head:
            feed(model, [head], a)
            feed(model, [head], b)
        x = model(mx.array([toks]), cache=a)[0, -2]
        y = model(mx.array([toks[:-1]]), cache=b)[0, -1]
        mx.eval(x, y)
        if raw(x) != raw(y):
            return False
        if can_trim_prompt_cache(a):
            trim_prompt_cache(a, 1)
            if live_state(a) != live_state(b):
                return False
    return True


def chunks_upto(chunks: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """The session's chunks cut at ``k`` tokens: a fresh prefill of the first ``k``."""
    out, n = [], 0
    for c in chunks:
        if n >= k:
            break
        out.append(list(c[: k - n]))
        n += len(out[-1])
    return out


def state_of(cache: list[Any]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """``live_state`` less persist's own bookkeeping: a quantized layer's
    ``min_resume_offset`` is where persist first saw it quantized (a fresh cache
    has none yet), not a part of mlx-lm's state."""
    out = live_state(cache)
    metas = {str(i): repr(_meta(encode_cache(c))) for i, c in enumerate(cache)}
    out["__meta__"] = ("", (), repr(metas).encode())
    return out


def _meta(rec: Any) -> Any:
    meta = {k: v for k, v in rec.meta.items() if k != "min_resume_offset"}
    return (rec.kind, meta, [_meta(c) for c in rec.children])


def comparable(cache: list[Any]) -> list[Any]:
    """The layers compared before the first continued call: all but chunked ones (a
    fresh prefill may still hold one position before its last chunk that mlx-lm's
    next front drop removes and the saved state no longer has; docs/FORMAT.md
    "Servable prefixes")."""
    return [c for c in cache if not isinstance(c, ChunkedKVCache)]


def same_continuation(
    model: Any,
    got: list[Any],
    want: list[Any],
    nxt: Sequence[int],
    after: Callable[[list[Any]], None] | None = None,
) -> None:
    """``got`` and ``want`` fed ``nxt`` one call each give the same logits and hold
    the same state after every call, bit for bit (``after``: kv_bits conversion)."""
    assert_same_state(state_of(comparable(got)), state_of(comparable(want)))
    for i, t in enumerate(nxt):
        a = model(mx.array([[t]]), cache=got)[0, -1]
        b = model(mx.array([[t]]), cache=want)[0, -1]
        if after is not None:
            after(got)
            after(want)
        mx.eval(a, b)
        assert raw(a) == raw(b), f"logits differ {i + 1} steps after the hit"
        assert_same_state(state_of(got), state_of(want))
