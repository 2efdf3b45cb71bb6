"""Mounts for the tests: read-only bind mounts (read-only stores) and small tmpfs
disks (a full disk); skipped where mounting is not permitted."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only_mount(path: Path) -> Iterator[None]:
    """``path`` bind-mounted read-only over itself; skip where mounting is refused."""
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        pytest.skip("mount --bind is not permitted here (a read-only store needs a mount)")
    try:
        remount = ["mount", "-o", "remount,bind,ro", str(path)]
        subprocess.run(remount, check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)  # lazy: mapped blobs may linger


@contextlib.contextmanager
def small_disk(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``3m``) mounted at ``mnt`` (made), private; skip where
    mounting is refused."""
    mnt.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
