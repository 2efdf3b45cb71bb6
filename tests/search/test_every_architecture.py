"""The state-space search over every architecture mlx-lm ships (issue 36).

Each module of ``mlx_lm.models`` not named in ``SKIPPED`` is built with tiny
arguments (tests/search/architectures.py) and searched with the machine of
tests/search/machine.py.  The first architecture (by name) of each cache-class
combination, its signature, gets more examples than the others, so each
distinct combination is searched deeper while every architecture is run.  A
module mlx-lm adds is searched at once (its test fails if it does not build:
give it overrides, or name it in ``SKIPPED`` with the reason).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import persist
from tests.helpers import ROOT
from tests.search.architectures import (
    SKIPPED,
    build,
    model_module,
    module_names,
    searched,
    signature,
)
from tests.search.machine import Tally, machine_for
from tests.search.oracle import calls_are_exact
from tests.search.results import LONG, record

LEADS: dict[tuple[str, ...], str] = {}  # signature -> the architecture searched deeper


def budget(lead: bool) -> settings:
    return settings(
        max_examples=(60 if lead else 14) if LONG else (10 if lead else 4),
        stateful_step_count=(25 if lead else 15) if LONG else (20 if lead else 12),
        deadline=None,
        derandomize=not LONG,  # the quick run is the same every time
        suppress_health_check=list(HealthCheck),
    )


def vocab_of(model: Any) -> int:
    """The token ids the model scores (its logits' width)."""
    return int(model(mx.array([[1]]))[0, -1].shape[-1])


def test_every_module_is_searched_or_skipped() -> None:
    names = module_names()
    assert set(SKIPPED) <= set(names), f"SKIPPED names no module: {set(SKIPPED) - set(names)}"
    for name, why in SKIPPED.items():
        if why.startswith("not an architecture"):
            assert model_module(name) is None, f"{name} has a Model now: search it"
    assert sorted([*searched(), *SKIPPED]) == names


def test_the_docs_name_every_skipped_module() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    missing = [n for n in SKIPPED if f"| {n} |" not in page]
    assert not missing, f"docs/testing.md does not name these skipped modules: {missing}"


@pytest.mark.parametrize("name", searched())
def test_every_architecture_hit_is_a_fresh_prefill(name: str) -> None:
    model = build(name)
    sig = signature(model)
    lead = LEADS.setdefault(sig, name) == name
    tally = Tally()
    vocab = vocab_of(model)
    exact = calls_are_exact(model, min(vocab, 250))
    ident = persist.ModelIdentity.of(model)
    processes = (2 if lead else 0) if LONG else 0  # the families' test restores in one too
    machine = machine_for(
        model, ident, tally, vocab, exact_calls=exact, recipe={"arch": name}, processes=processes
    )
    run_state_machine_as_test(machine, settings=budget(lead))
    assert tally.sequences > 0
    record("architectures", name, tally, signature=list(sig), exact_calls=exact, lead=lead)
