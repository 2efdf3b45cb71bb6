"""SIGKILL a process in the middle of saving, superseding and deleting.

After every kill ``check(fix=True)`` repairs only what a crash may leave
(orphans), ``check()`` is then empty, and every session is either its last
committed version or the one being written when the process died, restoring
bit for bit like a fresh prefill of its tokens.
"""

from __future__ import annotations

import json
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
from tests.reliability.conftest import scale

KILLS = int(os.environ.get("PERSIST_CRASH_KILLS", scale(20, 200)))


def run_until_killed(model_dir: Path, root: Path, seed: int, delay: float, journal: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.reliability.crash_child",
            str(model_dir),
            str(root),
            str(seed),
            str(journal),
        ],
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


def allowed_states(expected: dict[str, Any], journal: Path) -> dict[str, list[Any]]:
    """Per session, the states a crash may have left: committed, or the one in flight."""
    state = dict(expected)
    pending: dict[str, Any] = {}
    for line in journal.read_text().splitlines():
        e = json.loads(line)
        if e["phase"] == "begin":
            pending[e["name"]] = e.get("tokens")  # None: a delete
        else:
            state[e["name"]] = pending.pop(e["name"])
    out = {name: [toks] for name, toks in state.items()}
    for name, toks in pending.items():
        out.setdefault(name, [None]).append(toks)
    return out


@pytest.mark.long
def test_kill_while_saving(tiny: Any, tmp_path: Path, tally: Any) -> None:
    model, tok, model_dir = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path / "store"
    expected: dict[str, Any] = {}
    rng = random.Random(0)
    for trial in range(KILLS):
        journal = tmp_path / f"journal-{trial}"
        run_until_killed(model_dir, root, trial, rng.uniform(0.05, 1.5), journal)
        allowed = allowed_states(expected, journal)
        with persist.Store(root) as store:
            problems = store.check(fix=True)
            assert {p.kind for p in problems} <= {"orphan-tmp", "orphan-blob", "stale-pending"}, (
                problems
            )
            assert store.check() == []
            actual = {
                e.session: store.restore(e.session or "", identity=identity)
                for e in store.sessions()
            }
            for name in set(allowed) | set(actual):
                got = actual[name].tokens if name in actual else None
                ok = got in allowed.get(name, [None])
                tally.add("crash", **({"sessions_checked": 1} if ok else {"data_lost": 1}))
                assert ok, f"session {name} is in no committed state"
            for r in actual.values():
                fresh, _ = prefill(model, r.tokens, step=256)
                assert_same_state(live_state(fresh), live_state(r.cache))
        expected = {name: r.tokens for name, r in actual.items()}
        tally.add("crash", trials=1, kills=1, faults_injected=1, repaired=len(problems))
