"""Several processes and threads on one store at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import persist
from tests.helpers import ROOT, assert_same_state, live_state, prefill
from tests.store_helpers import clean
from tests.worker_child import work

OPS = int(os.environ.get("PERSIST_CONCURRENCY_OPS", "40"))


def test_processes_and_threads(tiny: Any, tmp_path: Path) -> None:
    model, tok, model_dir = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path / "store"
    persist.Store(root).close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.worker_child",
                str(model_dir),
                str(root),
                str(seed),
                str(OPS),
            ],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    errors: list[BaseException] = []
    model_lock = threading.Lock()  # MLX forward passes stay on one thread at a time
    with persist.Store(root) as store:

        def thread(seed: int) -> None:
            try:
                work(store, model, identity, seed, OPS // 2, model_lock)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=thread, args=(s,)) for s in (3, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err
        assert not errors, errors
        clean(store)
        for entry in store.sessions():
            restored = store.restore(entry.session or "", identity=identity)
            fresh, _ = prefill(model, restored.tokens, step=128)
            assert_same_state(live_state(fresh), live_state(restored.cache))
