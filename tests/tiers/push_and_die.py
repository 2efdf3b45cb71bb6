"""A machine that saves a turn of ``chat`` and stops between the tiers: its push has
moved the cold tier's pointer, not yet the shared one's, when it writes ``marker``
and waits to be killed (SIGKILL, by the test).  A real process and real servers:
``python -m tests.tiers.push_and_die JOB.json``, where JOB holds the store root,
both tier URLs, the operator key (hex), the marker path and the turn's tokens."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import persist
from tests.golden.cases import IDENTITY, kv_cache

WAIT_S = 600.0  # killed long before: the test waits for the marker, then kills


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    marker, tokens = Path(job["marker"]), list(job["tokens"])
    with persist.Store(
        job["store"], shared=job["shared"], cold=job["cold"], tier_key=bytes.fromhex(job["key"])
    ) as store:
        shared = store.shared
        assert shared is not None

        def between(*args: Any, **kwargs: Any) -> str:
            # push_everywhere pushes the cold tier first: it is done when Redis's starts
            marker.write_text("cold pushed")
            time.sleep(WAIT_S)
            raise SystemExit("not killed")

        shared.push = between  # type: ignore[method-assign]
        store.save([kv_cache(len(tokens), 2)], tokens, identity=IDENTITY, session="chat")


if __name__ == "__main__":
    main(sys.argv[1])
