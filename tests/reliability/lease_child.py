"""A writer that stops inside a save, its blobs on disk and not yet committed.

argv: model_dir store_dir session n_tokens seed go_file [clock_shift_seconds].
Prints ``paused`` once every blob of the save is written (the save's last
progress call, just before its commit), waits for ``go_file`` to appear, then
commits and prints ``saved`` or ``lost <error type>``.  ``clock_shift`` moves
this process's clock (a save that started that long ago by the checker's clock).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mlx_lm import load

import persist
from tests.helpers import prefill, tokens_for


def main() -> None:
    model_dir, root, session, n, seed, go = sys.argv[1:7]
    shift = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    if shift:
        real = time.time
        time.time = lambda: real() + shift  # injected clock: the pending row's age
    model, tok = load(model_dir)
    identity = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(int(n), seed=int(seed))
    cache, _ = prefill(model, toks)

    def progress(done: int, total: int) -> None:
        if done == total:  # every blob written, fsynced and renamed; commit next
            print("paused", flush=True)
            while not Path(go).exists():
                time.sleep(0.02)

    with persist.Store(root) as store:
        try:
            store.save(cache, toks, identity=identity, session=session, progress=progress)
        except persist.PersistError as e:
            print("lost", type(e).__name__, flush=True)
            return
    print("saved", flush=True)


if __name__ == "__main__":
    main()
