"""A process that saves, supersedes and deletes sessions until it is killed.

argv: model_dir store_dir seed journal.  Before each operation it journals
``begin``, after it ``done``; token lists are ``tokens_for(n, seed)``
(optionally extending the session's previous list, then in the same cache
objects, so the save is incremental), so the parent can recompute every cache
and knows which versions were committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from typing import Any

from mlx_lm import load

import persist
import persist.storage.blobs as blobs_module
from persist.storage.index import Index
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
    model_dir, root, seed, journal = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    model, tok = load(model_dir)
    identity = persist.ModelIdentity.of(model, tok)
    rng = random.Random(seed)
    widen_windows(random.Random(seed + 1))
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def note(**entry: Any) -> None:
        os.write(fd, (json.dumps(entry) + "\n").encode())  # in the kernel once written

    with persist.Store(root) as store:
        current = {
            s.session: store.restore(s.session or "", identity=identity).tokens
            for s in store.sessions()
        }
        caches: dict[str, tuple[Any, list[int]]] = {}  # session -> its cache, its tokens
        print("ready", flush=True)
        for _ in range(10_000):
            name = f"s{rng.randrange(4)}"
            if rng.random() < 0.15:
                note(op="delete", name=name, phase="begin")
                with contextlib.suppress(persist.SessionNotFoundError):
                    store.delete(name)
                current.pop(name, None)
                caches.pop(name, None)
                note(op="delete", name=name, phase="done")
                continue
            base = current.get(name, []) if rng.random() < 0.5 else []
            seed_i, n = rng.randrange(1 << 20), rng.randrange(1, 400)
            new = tokens_for(n, seed=seed_i)
            toks = base + new
            note(op="save", name=name, phase="begin", tokens=toks)
            if base and caches.get(name, (None, []))[1] == base:
                # the next turn in the same cache objects: an incremental save
                cache, _ = prefill(model, new, cache=caches[name][0], step=256)
            else:
                cache, _ = prefill(model, toks, step=256)
            caches[name] = (cache, toks)
            store.save(cache, toks, identity=identity, session=name)
            current[name] = toks
            note(op="save", name=name, phase="done")


if __name__ == "__main__":
    main()
