"""SIGKILL a process in the middle of saving: the store stays whole.

After every kill, ``check(fix=True)`` repairs what the crash left (orphan
files only), ``check()`` is then empty, and every session restores and
equals, bit for bit, a fresh prefill of the tokens it records.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import ROOT, assert_same_state, live_state, prefill

KILLS = int(os.environ.get("PERSIST_CRASH_KILLS", "6"))


def run_until_killed(model_dir: Path, root: Path, seed: int, delay: float) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.crash_child", str(model_dir), str(root), str(seed)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()


@pytest.mark.parametrize("trial", range(KILLS))
def test_kill_while_saving(trial: int, tiny: Any, tmp_path_factory: Any) -> None:
    model, tok, model_dir = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path_factory.getbasetemp() / "crash-store"  # one store across all kills
    rng = random.Random(trial)
    run_until_killed(model_dir, root, trial, rng.uniform(0.05, 1.5))
    with persist.Store(root) as store:
        problems = store.check(fix=True)
        print(
            f"kill {trial}: repaired {[p.kind for p in problems]}, {len(store.sessions())} sessions"
        )
        assert {p.kind for p in problems} <= {"orphan-tmp", "orphan-blob"}, problems
        assert store.check() == []
        for entry in store.sessions():
            restored = store.restore(entry.session or "", identity=identity)
            fresh, _ = prefill(model, restored.tokens, step=256)
            assert_same_state(live_state(fresh), live_state(restored.cache))
