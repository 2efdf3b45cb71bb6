"""Every file an option names is a regular file, read up to a stated bound.

Found from outside (round 5, attack 38b finding 12): ``persist serve --api-keys
/dev/zero`` and ``--public-prefix /dev/zero`` read the whole "file": a
MemoryError and exit 3 under a ulimit, an OOM kill without one; a FIFO with no
writer held the start forever (``--tier-key-file`` too).  Each is now one typed
line, exit 1.  Real processes under a 3 GiB address-space limit, the real
``/dev/zero`` (read-only), a real FIFO and a sparse file past the bound.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from persist.serve.tenants import KEY_FILE_BYTES, PUBLIC_FILE_BYTES
from tests.helpers import ROOT, pythonpath

LIMITS = {
    "--api-keys": KEY_FILE_BYTES,
    "--public-prefix": PUBLIC_FILE_BYTES,
    "--tier-key-file": 4096,
}


def _bounded() -> None:  # the child's memory: a whole /dev/zero read fails fast, not the host
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _serve(model: Path, store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "persist", "serve", "--model", str(model), "--store", str(store)]
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.run(
        [*cmd, "--port", "0", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, preexec_fn=_bounded,
    )  # fmt: skip


def _target(kind: str, tmp: Path, option: str) -> str:
    if kind == "zero":
        return "/dev/zero"  # the machine's own, only ever read
    p = tmp / f"{kind}-{option.strip('-')}"
    if kind == "fifo":
        os.mkfifo(p)  # nobody writes: a plain open waits forever
    else:  # sparse: one byte past the bound costs no disk
        with p.open("wb") as f:
            f.truncate(LIMITS[option] + 1)
    return str(p)


@pytest.mark.parametrize("option", list(LIMITS))
@pytest.mark.parametrize("kind", ["zero", "fifo", "oversized"])
def test_a_file_option_refuses_devices_fifos_and_oversized_files(
    model_dir: Any, tmp_path: Path, option: str, kind: str
) -> None:
    path = _target(kind, tmp_path, option)
    out = _serve(model_dir("llama"), tmp_path / "store", option, path)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("persist: error: "), out.stderr[-3000:]
    want = "is too long" if kind == "oversized" else "not a regular file"
    assert want in lines[0] and path in lines[0], lines
    if kind != "oversized":
        assert ("a character device" if kind == "zero" else "a FIFO") in lines[0], lines
