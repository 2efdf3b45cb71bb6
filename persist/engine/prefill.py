"""``persist.prefill``: a chunked prefill that leaves checkpoints in a store.

Recurrent state and wrapped rings cannot be trimmed, so a later prompt can
only resume from a snapshot taken exactly where its shared prefix ends.
This prefill stops at every checkpoint position and saves a snapshot there;
with blocks shared, each checkpoint costs about its own tail.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .. import policy
from ..errors import InvalidArgumentError, UnsupportedCacheError
from ..identity import ModelIdentity
from .cache_fit import refuse_unfit_kv_bits
from .layer_checks import MLX_LM_GROUP_SIZE

if TYPE_CHECKING:
    from .store import Store

__all__ = ["prefill", "stops"]


def stops(n: int, done: int, step: int, checkpoints: Iterable[int], every: int | None) -> list[int]:
    """Positions (after ``done``, up to ``n``) where a forward pass ends."""
    marks = {p for p in checkpoints if done < p <= n}
    if every:
        marks |= set(range(every, n + 1, every)) - set(range(done + 1))
    marks |= set(range(done + step, n, step)) | {n}
    return sorted(p for p in marks if p > done)


def prefill(
    model: Any,
    tokens: Sequence[int],
    *,
    cache: list[Any] | None = None,
    store: Store | None = None,
    identity: ModelIdentity | None = None,
    session: str | None = None,
    namespace: str = "default",
    checkpoints: Iterable[int] = (),
    checkpoint_every: int | None = None,
    step: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run ``tokens`` through ``model``; save a checkpoint at each requested position.

    ``cache`` may already cover a prefix of ``tokens`` (its offset says how
    much); prefill continues from there.  Checkpoints belong to ``session``
    (deleted with it) and serve prefix lookups of any prompt.  With ``store`` and
    ``identity``, every forward's time goes to the store's cost model.
    """
    from mlx_lm.models.cache import make_prompt_cache

    if step < 1:
        raise InvalidArgumentError("step must be >= 1")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise InvalidArgumentError("checkpoint_every must be >= 1")
    marks = set(checkpoints)
    if (marks or checkpoint_every) and (store is None or identity is None):
        raise InvalidArgumentError("checkpoints need a store and the model's identity")
    toks = [int(t) for t in tokens]
    if identity is not None:  # a kv_bits the caches cannot take: refused before any token
        refuse_unfit_kv_bits(model, identity)
    cache = make_prompt_cache(model) if cache is None else cache
    done = _offset(cache)
    if done > len(toks):
        raise InvalidArgumentError(
            f"the cache already covers {done} positions of {len(toks)} tokens"
        )
    quantize = _quantizer(identity)
    wanted = {p for p in marks if 0 < p <= len(toks)}
    if checkpoint_every:
        wanted |= set(range(checkpoint_every, len(toks) + 1, checkpoint_every))
    for end in stops(len(toks), done, step, wanted, None):
        while done < end:
            # A cache whose precision changes ahead (DelayedQuantizedKVCache) gets a
            # forward that stops exactly at its boundary.
            upto = min(end, done + _room(cache, end - done))
            t0 = time.perf_counter()
            model(mx.array([toks[done:upto]]), cache=cache)
            quantize(cache)
            mx.eval([c.state for c in cache])
            if store is not None and identity is not None:  # the cost model's prefill rate
                store.record_prefill(identity, done, upto, time.perf_counter() - t0)
            done = upto
        if progress is not None:
            progress(done, len(toks))
        if end in wanted and store is not None and identity is not None:
            store.checkpoint(
                cache, toks[:end], identity=identity, session=session, namespace=namespace
            )
    return cache


def _quantizer(identity: ModelIdentity | None) -> Callable[[list[Any]], None]:
    """What mlx-lm's generate_step does to the caches after every forward under the
    identity's kv_bits (``maybe_quantize_kv_cache``), so checkpoints hold the states
    a fresh run of that identity holds: plain below quantized_kv_start, quantized
    from it on (mlx-lm's default start where the identity names none)."""
    cfg = dict(identity.cache_config) if identity is not None else {}
    bits = cfg.get("kv_bits")
    if bits is None:
        return lambda cache: None
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

    start = cfg.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START)
    group = cfg.get("kv_group_size", MLX_LM_GROUP_SIZE)

    def quantize(cache: list[Any]) -> None:
        try:
            maybe_quantize_kv_cache(cache, start, group, bits)
        except NotImplementedError as e:  # mlx-lm: "RotatingKVCache Quantization NYI"
            raise UnsupportedCacheError(
                f"kv_bits={bits} from {start} positions on: mlx-lm cannot quantize a ring "
                f"(a sliding-window layer, or max_kv_size) ({e})"
            ) from e

    return quantize


def _room(cache: list[Any], want: int) -> int:
    rooms = [
        r
        for c in cache
        if hasattr(c, "max_append_tokens") and (r := c.max_append_tokens()) is not None and r > 0
    ]
    return min([want, *rooms])


def _offset(cache: list[Any]) -> int:
    """Positions the cache already covers (``policy.common_offset``; 0 for an empty cache)."""
    from ..codecs.snapshot import snapshot_facts

    return policy.common_offset(f.offset for f in snapshot_facts(cache)) or 0
