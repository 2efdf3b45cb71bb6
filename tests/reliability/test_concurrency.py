"""Four processes and several threads doing mixed operations on one store.

No unexpected error, no lost committed save (every session ends as its
owner last committed it), ``check()`` empty, unique bytes equal to the
bytes of the files on disk, and every session restores bit-exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import ROOT, assert_same_state, live_state, prefill
from tests.reliability.conftest import scale
from tests.reliability.worker_child import work
from tests.store_helpers import clean

OPS = int(os.environ.get("PERSIST_CONCURRENCY_OPS", scale(30, 300)))


@pytest.mark.long
def test_processes_and_threads(tiny: Any, tmp_path: Path, tally: Any) -> None:
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
                "tests.reliability.worker_child",
                str(model_dir),
                str(root),
                str(seed),
                str(OPS),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2, 3, 4)
    ]
    errors: list[BaseException] = []
    expected: dict[str, list[int] | None] = {}
    model_lock = threading.Lock()  # MLX forward passes stay on one thread at a time
    with persist.Store(root) as store:

        def thread(seed: int) -> None:
            try:
                expected.update(work(store, model, identity, seed, OPS // 2, model_lock))
            except BaseException as e:
                errors.append(e)

        def checker() -> None:  # check(fix=True) beside live writers must break nothing
            try:
                for _ in range(5):
                    problems = store.check(fix=True)
                    tally.add("concurrency", concurrent_checks=1, found=len(problems))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=thread, args=(s,)) for s in (5, 6)]
        threads.append(threading.Thread(target=checker))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in procs:
            out, err = p.communicate(timeout=1200)
            assert p.returncode == 0, err
            expected.update(json.loads(out.strip().splitlines()[-1]))
        assert not errors, errors
        clean(store)
        actual = {
            e.session: store.restore(e.session or "", identity=identity) for e in store.sessions()
        }
        for name, toks in expected.items():
            got = actual[name].tokens if name in actual else None
            tally.add(
                "concurrency", **({"sessions_checked": 1} if got == toks else {"data_lost": 1})
            )
            assert got == toks, f"lost the last committed save of {name}"
        assert set(actual) == {n for n, t in expected.items() if t is not None}
        for r in actual.values():
            fresh, _ = prefill(model, r.tokens, step=128)
            assert_same_state(live_state(fresh), live_state(r.cache))
    tally.add("concurrency", trials=1, processes=4, threads=2, operations=4 * OPS + OPS)
