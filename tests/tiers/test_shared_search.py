"""The state-space search with a shared tier (issue 36): every save pushes to a real
redis-server, and a new machine (a Store over an empty folder, the same Redis)
looks prompts up and restores sessions by name, pulling what it lacks; each
hit and restore is a fresh prefill of the tokens it claims, bit for bit
(tests/search/machine.py and far_rules.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import persist
from tests.search.machine import Tally, machine_for
from tests.search.results import LONG, record

BUDGET = settings(
    max_examples=60 if LONG else 10,
    stateful_step_count=25 if LONG else 15,
    deadline=None,
    derandomize=not LONG,
    suppress_health_check=list(HealthCheck),
)
# a plain, a ring, a chunked and a hybrid (recurrent checkpoints) family
FAMILIES = ["llama", "gemma3", "llama4", "qwen3_next"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_machine_pulls_only_fresh_prefills_from_the_fleet(
    tiny: Any, redis_server: Any, family: str
) -> None:
    model, tok, _ = tiny(family)
    tally = Tally()
    ident = persist.ModelIdentity.of(model, tok)
    machine = machine_for(model, ident, tally, shared=redis_server.url)
    run_state_machine_as_test(machine, settings=BUDGET)
    assert tally.pulls > 0
    record("shared", family, tally)
