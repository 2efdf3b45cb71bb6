"""A process of the race tests: ``writer``, ``checker``, ``reader`` or ``gc`` on one store.

argv: role store_root seconds out_file (role ``exporter`` too).  The writer re-saves a few named
sessions with new contents (distinct lengths, so a version is its token
list) and appends each save that *returned* to out_file, fsynced, so the
test knows every committed version.  The others loop until the time is up
and write the count of each outcome (exception type names) to out_file.
Caches are fed keys directly (no model), so the loops are fast.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs

NAMES = [f"s{i}" for i in range(6)]


def version(name: str, n: int) -> tuple[list[int], mc.KVCache]:
    c = mc.KVCache()
    c.update_and_fetch(*kvs(zlib.crc32(f"{name}/{n}".encode()) % 10_000, n))
    return [(i * 7 + n) % 5000 for i in range(n)], c


def writer(store: persist.Store, until: float, out: Path) -> None:
    rng = random.Random(os.getpid())
    with out.open("a") as log:
        while time.time() < until:
            name, n = rng.choice(NAMES), rng.randrange(20, 700)
            tokens, cache = version(name, n)
            store.save([cache], tokens, identity=IDENTITY, session=name)
            log.write(json.dumps([name, n]) + "\n")
            log.flush()
            os.fsync(log.fileno())


def loop(role: str, store: persist.Store, until: float, out_dir: Path) -> Counter[str]:
    seen: Counter[str] = Counter()
    rng = random.Random(os.getpid())
    while time.time() < until:
        try:
            if role == "checker":
                store.check(fix=True)
            elif role == "reader":
                store.restore(rng.choice(NAMES), identity=IDENTITY)
            elif role == "gc":
                store.gc()
            elif role == "exporter":  # attack r13b: a false CorruptBlobError beside saves
                store.export(rng.choice(NAMES), Path(f"{out_dir}/export.safetensors"))
            seen["ok"] += 1
        except persist.SessionNotFoundError:
            seen["not-yet-saved"] += 1
        except Exception as e:  # counted: the test says which are allowed
            seen[type(e).__name__] += 1
    return seen


def main() -> None:
    role, root, seconds, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    until = time.time() + seconds
    with persist.Store(root) as store:
        if role == "writer":
            writer(store, until, out)
        else:
            out.write_text(json.dumps(loop(role, store, until, out.parent)))


if __name__ == "__main__":
    main()
