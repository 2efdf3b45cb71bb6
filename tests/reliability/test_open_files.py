"""A session of more blocks than the open-file limit saves, restores, hits and exports.

Round 1 kept every blob of a snapshot open until the end: with 256 open files
(macOS's default) a 70,000-token session (273 blocks) never restored.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

CHILD = """
import resource, sys
from pathlib import Path
from mlx_lm.models import cache as mc
import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import raw
# after the imports: mlx_lm raises the soft limit to 2048 when it is imported
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
out = Path(sys.argv[1])
n = 70_000
c = mc.KVCache()
keys, values = kvs(3, n)
c.update_and_fetch(keys, values)
toks = [i % 4096 for i in range(n)]
with persist.Store(out / "s") as s:
    s.save([c], toks, identity=IDENTITY, session="long")
    got = s.restore("long", identity=IDENTITY)
    assert raw(got.cache[0].keys[..., :n, :]) == raw(keys)
    hit = s.lookup(toks[:60_000] + [5000, 5001], identity=IDENTITY)
    assert hit is not None and len(hit.tokens) == 60_000
    assert raw(hit.cache[0].values[..., :60_000, :]) == raw(values[..., :60_000, :])
    s.export("long", out / "long.safetensors")
    assert persist.load_file(out / "long.safetensors").tokens == toks
    assert s.check() == []
print("ok")
"""


def test_more_blocks_than_open_files(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
