"""``persist serve --warm N``: each model the server loads (the default one before the
server listens, any other when a request swaps to it) gets its N most valuable
store entries read into the host tier, so a returning conversation after a
restart is answered from RAM instead of a disk read (``engine.warm``).

``first_forward``: before the server listens, the default model runs one short
prefill and one decode step, so the kernels MLX compiles at first use (several
seconds for an 8B model on CUDA) are built before the first request, not in it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..engine.host.tier import HostTier
from ..engine.store import Store
from ..engine.warm import warm
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity

__all__ = ["first_forward", "warmer"]

WARMUP_TOKENS = 256  # a prefill longer than one decode step: both kinds of kernels

log = logging.getLogger("persist")


def warmer(store: Store, host: HostTier | None, n: int) -> Callable[[ModelIdentity], None] | None:
    """What to run when a model is loaded (None: nothing to warm).  A failure is
    logged, never raised: a cold start still serves."""
    if n <= 0:
        return None
    if host is None:
        log.warning("persist: --warm needs the host tier (--host-cache): nothing warmed")
        return None

    def run(identity: ModelIdentity) -> None:
        try:
            r = warm(
                store.index,
                store.blobs,
                host,
                identity=identity,
                n=n,
                namespace=None,
                strict_backend=store.strict_backend,
            )
        except Exception as e:
            log.warning("persist: warm start failed: %s", e)
            return
        log.info(
            "persist: warm start: %d entries (%d tokens, %d bytes) of %s read into RAM "
            "in %.2f s%s",
            r.entries, r.tokens, r.bytes, identity.display(), r.seconds,
            f"; {r.skipped} skipped" if r.skipped else "",
        )  # fmt: skip

    return run


def first_forward(model_provider: Any) -> float | None:
    """Load the default model and run it once (seconds taken; None: no default model,
    or it failed, which the generation thread then reports as it always does).
    Options the model cannot serve (InvalidArgumentError) stop the start."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    try:
        model_provider.load_default()
        model = model_provider.model
        if model is None:
            return None
        cache = make_prompt_cache(model)
        ids = model_provider.tokenizer.encode("warm up " * WARMUP_TOKENS)[:WARMUP_TOKENS]
        logits = model(mx.array([ids]), cache=cache)
        mx.eval(logits)
        mx.eval(model(mx.argmax(logits[:, -1:], axis=-1), cache=cache))
    except InvalidArgumentError:
        raise  # options this model cannot serve (kv_bits on rings): refused at start
    except Exception as e:
        log.warning("persist: the first forward pass at start failed: %s", e)
        return None
    return time.perf_counter() - t0
