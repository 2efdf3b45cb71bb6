"""A process that saves, supersedes and deletes sessions until it is killed.

argv: model_dir store_dir seed.  Token lists come from ``tokens_for``, so the
parent can recompute every cache from the tokens a session records.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from typing import Any

from mlx_lm import load

import persist
import persist.store.blobs as blobs_module
from persist.store.index import Index
from tests.helpers import prefill, tokens_for


def widen_windows(rng: random.Random) -> None:
    """Fault injection: pause inside the write protocol so kills land there."""
    real_rename, real_forget = os.rename, Index.forget

    def slow_rename(a: Any, b: Any) -> None:
        time.sleep(rng.uniform(0, 0.03))  # tmp written and fsynced, not yet renamed
        real_rename(a, b)
        time.sleep(rng.uniform(0, 0.03))  # renamed, not yet in the index

    def slow_forget(self: Index, files: Any) -> None:
        time.sleep(rng.uniform(0, 0.03))  # files unlinked, rows not yet forgotten
        real_forget(self, files)

    blobs_module.os.rename = slow_rename  # type: ignore[attr-defined]
    Index.forget = slow_forget  # type: ignore[method-assign]


def main() -> None:
    model_dir, root, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, tok = load(model_dir)
    identity = persist.ModelIdentity.of(model, tok)
    rng = random.Random(seed)
    widen_windows(random.Random(seed + 1))
    print("ready", flush=True)
    with persist.Store(root) as store:
        for i in range(10_000):
            name = f"s{rng.randrange(4)}"
            if rng.random() < 0.15:
                with contextlib.suppress(persist.SessionNotFoundError):
                    store.delete(name)
                continue
            toks = tokens_for(rng.randrange(1, 700), seed=rng.randrange(1 << 20))
            cache, _ = prefill(model, toks, step=256)
            store.save(cache, toks, identity=identity, session=name)
            print("saved", i, name, len(toks), flush=True)


if __name__ == "__main__":
    main()
