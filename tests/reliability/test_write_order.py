"""Every byte of a file is written before its last fsync, and the rename comes after it.

Traced with strace on a real save (store blobs, ``save_file``, ``export``).
Round 1 fsynced a file, then rewrote its header with the real checksums:
durable through a process crash, lost on a power cut.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

CHILD = """
import sys
from pathlib import Path
from mlx_lm.models import cache as mc
import persist
from tests.golden.cases import IDENTITY, kvs
out = Path(sys.argv[1])
c = mc.KVCache()
c.update_and_fetch(*kvs(1, 700))
with persist.Store(out / "store") as s:
    s.save([c], list(range(700)), identity=IDENTITY, session="a")
    s.export("a", out / "a.safetensors")
persist.save_file(out / "b.safetensors", [c], list(range(700)))
"""

CALL = re.compile(r"^(?:\d+ +)?(\w+)\((.*)")
FD = re.compile(r"^(-?\d+)<([^>]*)>")
WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2", "ftruncate"}


def events(log: str) -> list[tuple[str, str]]:
    """(call, path) in the order the kernel saw them; renames give their source path."""
    out = []
    for line in log.splitlines():
        m = CALL.match(line)
        if not m or "<unfinished" in line:
            continue
        call, rest = m.groups()
        if call in WRITES | {"fsync", "fdatasync"}:
            fd = FD.match(rest)
            if fd:
                out.append((call, fd.group(2)))
        elif call in ("rename", "renameat", "renameat2"):
            src = re.findall(r'"([^"]*)"', rest)
            if src:
                out.append(("rename", src[0]))
    return out


@pytest.mark.skipif(
    shutil.which("strace") is None and not os.environ.get("CI"),
    reason="strace is installed by .ci/run (in CI a missing strace fails this test)",
)
def test_no_file_is_written_after_its_last_fsync(tmp_path: Path) -> None:
    log = tmp_path / "trace"
    subprocess.run(
        [
            "strace", "-f", "-qq", "-y", "-o", str(log),
            "-e", "trace=write,pwrite64,writev,pwritev,pwritev2,ftruncate,fsync,fdatasync,"
            "rename,renameat,renameat2",
            sys.executable, "-c", CHILD, str(tmp_path),
        ],
        check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    seen = events(log.read_text())
    renamed = [(i, p) for i, (c, p) in enumerate(seen) if c == "rename" and p.endswith(".tmp")]
    assert len(renamed) >= 3, seen[-20:]  # blobs, the export, save_file
    for at, path in renamed:
        before = [(c, i) for i, (c, p) in enumerate(seen[:at]) if p.endswith(path.lstrip("."))]
        last_sync = max((i for c, i in before if c in ("fsync", "fdatasync")), default=-1)
        last_write = max((i for c, i in before if c in WRITES), default=-1)
        assert last_sync > last_write >= 0, f"{path}: written after its last fsync"
