"""What a long search run checked, kept in bench/results/state-space-search.json.

Only ``PERSIST_LONG=1`` runs write it (the quick run's numbers are not a
result); each test merges its own entries under one section, so runs of
different test modules add up in one file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from tests.helpers import ROOT
from tests.search.machine import Tally

LONG = os.environ.get("PERSIST_LONG") == "1"
OUT = ROOT / "bench" / "results" / "state-space-search.json"


def record(section: str, key: str, tally: Tally, **facts: object) -> None:
    """Keep ``tally`` (and ``facts``) as ``section``/``key`` of the results, in a long run."""
    if not LONG:
        return
    got = json.loads(OUT.read_text()) if OUT.exists() else {}
    entry = {**asdict(tally), "by_length": len(tally.by_length), **facts}
    got.setdefault(section, {})[key] = entry
    OUT.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
