"""A process doing a bounded mix of store operations (for concurrency tests).

argv: model_dir store_dir seed ops.  Exits non-zero on any unexpected error.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from typing import Any

from mlx_lm import load

import persist
from tests.helpers import prefill, tokens_for


def work(
    store: persist.Store,
    model: Any,
    identity: persist.ModelIdentity,
    seed: int,
    ops: int,
    lock: Any = None,
) -> dict[str, list[int] | None]:
    """Mixed operations; returns each own session's last committed tokens (None: deleted).

    ``lock`` guards the model's forward passes (threads share one model).
    """
    lock = contextlib.nullcontext() if lock is None else lock
    rng = random.Random(seed)
    shared = tokens_for(300, seed=4242)  # every worker shares this prefix
    final: dict[str, list[int] | None] = {}
    for _ in range(ops):
        op = rng.random()
        name = f"w{seed}-{rng.randrange(3)}"
        if op < 0.45:
            toks = shared[: rng.randrange(0, 300)] + tokens_for(
                rng.randrange(1, 200), seed=rng.randrange(1 << 20)
            )
            with lock:
                cache, _ = prefill(model, toks, step=128)
            store.save(cache, toks, identity=identity, session=name)
            final[name] = toks
        elif op < 0.7:
            store.lookup(shared[:280] + [1, 2, 3], identity=identity)
        elif op < 0.85:
            with contextlib.suppress(persist.SessionNotFoundError):
                store.restore(name, identity=identity)
        elif op < 0.95:
            with contextlib.suppress(persist.SessionNotFoundError):
                store.delete(name)
            final[name] = None
        else:
            store.gc()
    return final


def main() -> None:
    model_dir, root, seed, ops = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model, tok = load(model_dir)
    with persist.Store(root) as store:
        final = work(store, model, persist.ModelIdentity.of(model, tok), seed, ops)
    print(json.dumps(final))


if __name__ == "__main__":
    main()
