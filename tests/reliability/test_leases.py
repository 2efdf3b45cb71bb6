"""``persist check --fix`` beside a save in flight: a lease, not pids and clocks.

A real writer process stops with every blob of its save on disk, just before
its commit; a real ``persist check --fix`` process runs beside it with a
clock two hours ahead, or while the save is older than ``TMP_GRACE_SECONDS``
by the writer's clock, or from another PID namespace (where the writer's pid
does not exist).  Then the writer commits: every committed session (the one
saved before and the new one) restores bit for bit like a fresh prefill.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import persist
from bench.servers import Server
from persist.storage.check import TMP_GRACE_SECONDS
from tests.helpers import ROOT, assert_same_state, live_state, prefill, pythonpath, tokens_for

AHEAD = 2 * 3600.0
# persist's CLI with this process's clock moved (the checker's clock stepped)
SHIFTED_CLI = (
    "import sys, time; real, shift = time.time, float(sys.argv.pop(1)); "
    "time.time = lambda: real() + shift; sys.argv[0] = 'persist'; "
    "from persist.cli import main; main()"
)


class Writer:
    """tests/reliability/lease_child.py: a save stopped just before its commit."""

    def __init__(
        self, model_dir: Path, root: Path, tmp: Path, shift: float = 0.0, name: str = "chat"
    ) -> None:
        self.go = tmp / f"go-{name}"
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        args = [str(model_dir), str(root), name, "300", "7", str(self.go), str(shift)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.lease_child", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "paused"
        self.age(root, 60.0 - shift)

    @staticmethod
    def age(root: Path, seconds: float) -> None:
        """Date the saves' blobs ``seconds`` back, as written at their start (a save
        runs a while: its first blobs are as old as it), without waiting."""
        db = sqlite3.connect(root / "index.sqlite")
        salts = [r[0] for r in db.execute("SELECT salt FROM pending")]
        db.close()
        when = time.time() - seconds
        for salt in salts:
            for f in (root / "blobs").rglob(f"*.{salt}.safetensors"):
                os.utime(f, (when, when))

    def finish(self) -> str:
        self.go.touch()
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0
        return out.strip()


@pytest.fixture
def beside(tiny: Any, tmp_path: Path) -> Iterator[tuple[Any, Path, list[int]]]:
    """A store holding one committed session, ``kept``."""
    model, tok, model_dir = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path / "store"
    kept = tokens_for(200, seed=3)
    with persist.Store(root) as store:
        store.save(prefill(model, kept)[0], kept, identity=identity, session="kept")
    yield model_dir, root, kept


def check_cli(root: Path, *prefix: str, shift: float = 0.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    args = ["check", "--fix", "--store", str(root)]
    cmd = [*prefix, sys.executable, "-c", SHIFTED_CLI, str(shift), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    # the paused save's files are leased: the check finds nothing to report or fix
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out


def assert_nothing_lost(tiny: Any, root: Path, kept: list[int], saved: bool) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    want = {"kept": kept, **({"chat": tokens_for(300, seed=7)} if saved else {})}
    with persist.Store(root) as store:
        assert {s.session for s in store.sessions()} == set(want)
        for name, toks in want.items():
            got = store.restore(name, identity=identity)
            assert got.tokens == toks
            assert_same_state(live_state(got.cache), live_state(prefill(model, toks)[0]))
        assert store.check(fix=True) == []


@pytest.mark.parametrize(
    "shift, writer_shift",
    [(AHEAD, 0.0), (0.0, -(TMP_GRACE_SECONDS + AHEAD))],
    ids=["checker-clock-2h-ahead", "save-longer-than-grace"],
)
def test_check_beside_a_save_loses_nothing(
    tiny: Any, tmp_path: Path, beside: Any, shift: float, writer_shift: float
) -> None:
    model_dir, root, kept = beside
    writer = Writer(model_dir, root, tmp_path, writer_shift)
    try:
        out = check_cli(root, shift=shift)
    finally:
        result = writer.finish()
    assert "orphan-blob" not in out.stdout + out.stderr
    assert result == "saved"
    assert_nothing_lost(tiny, root, kept, saved=True)


def test_check_from_another_pid_namespace(tiny: Any, tmp_path: Path, beside: Any) -> None:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--pid", "--fork", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip("no PID namespace here: unshare --pid is missing or not permitted")
    model_dir, root, kept = beside
    writer = Writer(model_dir, root, tmp_path)
    try:
        check_cli(root, unshare, "--pid", "--fork")
    finally:
        result = writer.finish()
    assert result == "saved"
    assert_nothing_lost(tiny, root, kept, saved=True)


def test_a_save_whose_files_were_removed_does_not_commit(
    tiny: Any, tmp_path: Path, beside: Any
) -> None:
    """A check that cannot see the lease at all (another kernel over a network
    filesystem, an older persist) ends the save's row and removes its files:
    the save then fails typed instead of listing a session whose blobs are gone."""
    model_dir, root, kept = beside
    writer = Writer(model_dir, root, tmp_path)
    try:
        db = sqlite3.connect(root / "index.sqlite")
        with db:
            (salt,) = db.execute("SELECT salt FROM pending").fetchone()
            db.execute("DELETE FROM pending")
        db.close()
        for f in (root / "blobs").rglob(f"*.{salt}.safetensors"):
            f.unlink()
    finally:
        result = writer.finish()
    assert result == "lost SaveLostError"
    assert_nothing_lost(tiny, root, kept, saved=False)


def test_a_save_whose_row_alone_was_ended_does_not_commit(
    tiny: Any, tmp_path: Path, beside: Any
) -> None:
    model_dir, root, kept = beside
    writer = Writer(model_dir, root, tmp_path)
    try:
        db = sqlite3.connect(root / "index.sqlite")
        with db:
            db.execute("DELETE FROM pending")
        db.close()
    finally:
        result = writer.finish()
    assert result == "lost SaveLostError"
    assert_nothing_lost(tiny, root, kept, saved=False)


def test_serve_removes_what_killed_writers_left(tiny: Any, tmp_path: Path, beside: Any) -> None:
    """A writer killed mid-save leaves its pending row, blob files and lease; a
    restarted ``persist serve`` removes them at start, and leaves a save that is
    still in flight in another process alone."""
    model_dir, root, kept = beside
    killed = Writer(model_dir, root, tmp_path, name="killed")
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(timeout=60)
    writer = Writer(model_dir, root, tmp_path)
    try:
        srv = Server(
            ["persist", "serve", "--model", str(model_dir), "--store", str(root)], tmp_path / "log"
        )
        srv.stop()
    finally:
        result = writer.finish()
    assert result == "saved"
    assert re.search(
        r"removed [1-9]\d* leftovers of interrupted saves", (tmp_path / "log").read_text()
    )
    assert_nothing_lost(tiny, root, kept, saved=True)


@pytest.mark.parametrize("where", ["open", "lock"])
def test_a_ctrl_c_while_a_lease_is_taken_leaves_no_lease_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # attack r15: a Ctrl-C as the lease file was made left it in tmp/, held by no one
    # ("a dead save's lease, its writer is gone" beside a live process)
    from persist.storage import leases

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    real_open, real_lock = os.open, leases._lock

    def opened(path: Any, *a: Any, **k: Any) -> int:
        fd = real_open(path, *a, **k)
        if str(path).endswith(".lease"):
            raise KeyboardInterrupt  # as the call returned: the file is there
        return fd

    def locked(fd: int) -> bool:
        real_lock(fd)
        raise KeyboardInterrupt

    if where == "open":
        monkeypatch.setattr(leases.os, "open", opened)
    else:
        monkeypatch.setattr(leases, "_lock", locked)
    with pytest.raises(KeyboardInterrupt):
        leases.take(tmp)
    monkeypatch.undo()
    assert list(tmp.iterdir()) == []
    lease = leases.take(tmp)  # and the next one is taken as ever
    lease.release()
