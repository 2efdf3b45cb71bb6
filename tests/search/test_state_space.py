"""The state-space search (issue 36 item 3), one run per tiny model family.

The default budget is quick (a few sequences per family); ``PERSIST_LONG=1``
runs the long one and writes what it checked to
bench/results/state-space-search.json.  A failure Hypothesis finds is shrunk
and printed as a sequence of steps: keep it as a plain regression test.
Families: every cache family persist's tiny models have, two run with kv_bits
(mlx-lm converts their KV layers to QuantizedKVCache mid-session) and llama on
a cache list of ConcatenateKVCache.
Each restores a session in a fresh process at most ``PROCESSES`` times, and
serves requests in a batch and with a draft model where mlx-lm's server does.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from mlx_lm.models.cache import ConcatenateKVCache

import persist
from tests.search.machine import Tally, machine_for
from tests.search.oracle import Quant
from tests.search.results import LONG, record

BUDGET = settings(
    max_examples=100 if LONG else 10,
    stateful_step_count=30 if LONG else 15,
    deadline=None,
    derandomize=not LONG,  # the quick run is the same every time
    suppress_health_check=list(HealthCheck),
)
PROCESSES = 4 if LONG else 1
# tiny models of each cache family: plain KV, sliding window rings, chunked
# attention, recurrent state (Mamba), hybrids (gated delta, Mamba + attention);
# and kv_bits sessions (a plain and a hybrid model) converted at a start the
# sessions pass
FAMILIES: dict[str, tuple[str, Quant | None]] = {
    "llama": ("llama", None),
    "gemma3": ("gemma3", None),
    "llama4": ("llama4", None),
    "mamba2": ("mamba2", None),
    "qwen3_next": ("qwen3_next", None),
    "falcon_h1": ("falcon_h1", None),
    "llama+kv4": ("llama_hd64", Quant(bits=4, group=32, start=24)),
    "qwen3_next+kv8": ("qwen3_next_hd32", Quant(bits=8, group=32, start=40)),
    "llama+concat": ("llama", None),
}
# the draft model of serve_draft's "other" draft: a tiny llama of the same vocabulary
DRAFT = "llama_hd64"
# a cache list a user builds of one class (no model makes ConcatenateKVCache itself);
# its own trim only lowers the offset, so mlx-lm's rollback is not searched on it
CACHE_CLASS = {"llama+concat": ConcatenateKVCache}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_hit_and_restore_is_a_fresh_prefill(tiny: Any, family: str) -> None:
    variant, quant = FAMILIES[family]
    model, tok, model_dir = tiny(variant)
    tally = Tally()
    ident = persist.ModelIdentity.of(model, tok, **(quant.identity() if quant else {}))
    recipe = {"dir": str(model_dir)}
    cls = CACHE_CLASS.get(family)
    draft, draft_tok, _ = tiny(DRAFT)
    parts = {
        "cache_class": cls,
        "rollbacks": cls is None,
        "serving": True,  # batched and draft-model serving (persist serve)
        "draft_model": draft,
        "draft_identity": persist.ModelIdentity.of(draft, draft_tok),
    }
    machine = machine_for(
        model, ident, tally, quant=quant, recipe=recipe, processes=PROCESSES, **parts
    )
    run_state_machine_as_test(machine, settings=BUDGET)
    assert tally.sequences > 0
    assert quant is None or tally.conversions > 0  # the search reached quantized states
    record("families", family, tally)
