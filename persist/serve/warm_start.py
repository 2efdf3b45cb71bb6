"""``persist serve --warm N``: each model the server loads (the default one before the
server listens, any other when a request swaps to it) gets its N most valuable
store entries read into the host tier, so a returning conversation after a
restart is answered from RAM instead of a disk read (``engine.warm``).

``first_forward``: before the server listens, the default model runs a prompt
through mlx-lm's own batched prefill (the path every batchable request takes)
and two decode steps, so the kernels MLX builds at first use (several seconds
for an 8B model on CUDA) are built before the first request, not in it.  On a
GPU the prompt is two and a half of mlx-lm's prefill chunks (a full chunk, one
attending to a chunk before it, a partial one): a 256-token warm-up left the
H200's first 7,133-token prompt at 1.25 s against about 0.3 s later.  On the
CPU, which builds no kernels per shape, 256 tokens."""

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

WARMUP_TOKENS = 256  # on the CPU: a prefill longer than one decode step
MAX_STEPS = 10_000  # a warm-up's generator steps, at most (a changed mlx-lm never hangs it)

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


def warmup_tokens(step: int, gpu: bool, context: int | None) -> int:
    """Prompt tokens of the warm-up: on a GPU two and a half prefill chunks of ``step``
    tokens, on the CPU WARMUP_TOKENS; never past the model's ``context``."""
    n = 2 * step + step // 2 if gpu else WARMUP_TOKENS
    return max(2, min(n, context - 3)) if context else n


def first_forward(model_provider: Any) -> float | None:
    """Load the default model and run a prompt through it (seconds taken; None: no
    default model, or it failed, which the generation thread then reports as it
    always does).  Options the model cannot serve (InvalidArgumentError) stop the
    start."""
    import mlx.core as mx

    from .bounds import context_length

    t0 = time.perf_counter()
    try:
        model_provider.load_default()
        model = model_provider.model
        if model is None:
            return None
        args = model_provider.cli_args
        step = int(getattr(args, "prefill_step_size", 0) or 2048)
        gpu = mx.default_device() != mx.cpu
        n = warmup_tokens(step, gpu, context_length(model))
        ids = model_provider.tokenizer.encode("warm up " * n)[:n]
        if getattr(model_provider, "is_batchable", False) and getattr(args, "kv_bits", 0) is None:
            batched(model, ids, step)
        else:  # mlx-lm serves this model (or these options) one request at a time
            alone(model, ids, step)
    except InvalidArgumentError:
        raise  # options this model cannot serve (kv_bits on rings, a draft beside rings:
        # the loader refuses them, serve/model_identity): refused at start
    except Exception as e:
        log.warning("persist: the first forward pass at start failed: %s", e)
        return None
    return time.perf_counter() - t0


def batched(model: Any, ids: list[int], step: int) -> int:
    """``ids`` through mlx-lm's BatchGenerator (chunks of ``step``), then two decode
    steps; the prompt tokens it processed."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=2, prefill_step_size=step)
    try:
        gen.insert([ids], max_tokens=[2])
        for _ in range(MAX_STEPS):
            _, done = gen.next()
            if any(r.finish_reason is not None for r in done):
                return int(getattr(getattr(gen, "_counters", None), "prompt_tokens", 0))
        raise RuntimeError(f"the warm-up did not finish in {MAX_STEPS} steps")
    finally:
        gen.close()


def alone(model: Any, ids: list[int], step: int) -> None:
    """``ids`` through a fresh prompt cache in chunks of ``step``, then a decode step."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(ids), step):
        logits = model(mx.array([ids[i : i + step]]), cache=cache)
        mx.eval(logits)
    mx.eval(model(mx.argmax(logits[:, -1:], axis=-1), cache=cache))
