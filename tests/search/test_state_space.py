"""The state-space search (issue 36 item 3), one run per tiny model family.

The default budget is quick (a few sequences per family); ``PERSIST_LONG=1``
runs the long one and writes what it checked to
bench/results/state-space-search.json.  A failure Hypothesis finds is shrunk
and printed as a sequence of steps: keep it as a plain regression test.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import persist
from tests.helpers import ROOT
from tests.search.machine import Tally, machine_for

LONG = os.environ.get("PERSIST_LONG") == "1"
BUDGET = settings(
    max_examples=40 if LONG else 5,
    stateful_step_count=25 if LONG else 12,
    deadline=None,
    derandomize=not LONG,  # the quick run is the same every time
    suppress_health_check=list(HealthCheck),
)
# tiny models of each cache family: plain KV, sliding window rings, chunked
# attention, recurrent state (Mamba), hybrids (gated delta, Mamba + attention)
FAMILIES = ["llama", "gemma3", "llama4", "mamba2", "qwen3_next", "falcon_h1"]
TALLIES: dict[str, Tally] = {}


@pytest.mark.parametrize("variant", FAMILIES)
def test_every_hit_and_restore_is_a_fresh_prefill(tiny: Any, variant: str) -> None:
    model, tok, _ = tiny(variant)
    tally = TALLIES.setdefault(variant, Tally())
    machine = machine_for(model, persist.ModelIdentity.of(model, tok), tally)
    run_state_machine_as_test(machine, settings=BUDGET)
    assert tally.sequences > 0
    if LONG:
        out = ROOT / "bench" / "results" / "state-space-search.json"
        got = json.loads(out.read_text()) if out.exists() else {}
        got[variant] = {**asdict(tally), "by_length": len(tally.by_length)}
        out.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
