"""DeepSeek-V4's layer cache (mlx-lm's deepseek_v41.LayerCache): kind ``deepseek-v4-layer``.

Its index layers pick keys by top-k, and on the CPU backend that forward is
not deterministic run to run, while the cache state a prefill leaves is.  So
the model with index layers is checked state for state, and a configuration
without them logits for logits as well.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import (
    NEXT,
    ROOT,
    assert_same_state,
    check_against_child,
    continue_run,
    live_state,
    prefill,
    raw,
    run_child,
    tokens_for,
)

LENGTHS = [1, 7, 28, 45, 130]  # 28: a group just closed, so pending rows are (1, 0, 32)


def test_importing_persist_does_not_import_the_model() -> None:
    code = (
        "import sys, persist; persist.kind_of; print('mlx_lm.models.deepseek_v41' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_kind_and_facts(tiny: Any) -> None:
    model, _, _ = tiny("deepseek_v4")
    cache = prefill(model, tokens_for(28))[0]
    assert {persist.kind_of(c) for c in cache} == {"deepseek-v4-layer"}
    assert cache[1].pending_kv.shape == (1, 0, 32)  # zero rows: stored as zero rows
    assert cache[0].compress_kv is None  # a layer that does not compress: stored as None
    assert all(not c.is_trimmable() for c in cache)


@pytest.mark.parametrize("variant", ["deepseek_v4", "deepseek_v4_noindex"])
def test_round_trip_in_a_fresh_process(variant: str, tiny: Any, tmp_path: Path) -> None:
    model, _, model_dir = tiny(variant)
    jobs, originals = [], []
    for n in LENGTHS:
        prompt = tokens_for(n, seed=n)
        cache = prefill(model, prompt, step=16)[0]
        f, out = tmp_path / f"{n}.safetensors", tmp_path / f"{n}-out.safetensors"
        persist.save_file(f, cache, prompt)
        jobs.append({"file": str(f), "next": NEXT, "out": str(out)})
        originals.append((cache, out, prompt))
    run_child(model_dir, jobs, tmp_path)
    for cache, out, prompt in originals:
        if variant == "deepseek_v4_noindex":
            check_against_child(model, cache, out, prompt)
        else:
            import mlx.core as mx

            from tests.helpers import decode_state

            meta = mx.load(str(out), return_metadata=True)[1]
            assert_same_state(live_state(cache), decode_state(meta["before"]))
            restored = persist.load_file(tmp_path / f"{len(prompt)}.safetensors").cache
            continue_run(model, restored, NEXT)
            continue_run(model, cache, NEXT)
            # both continued the same tokens: the same state again (logits may differ)
            assert_same_state(live_state(restored), live_state(cache))


def test_checkpoints_through_prefill(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("deepseek_v4_noindex")
    identity = persist.ModelIdentity.of(model, tok)
    doc = tokens_for(200, seed=4)
    with persist.Store(tmp_path / "s") as store:
        persist.prefill(
            model, doc, store=store, identity=identity, session="doc", checkpoint_every=64, step=32
        )
        prompt = doc[:150] + [7, 8, 9]
        hit = store.lookup(prompt, identity=identity)
        assert hit is not None and len(hit.tokens) == 128  # the deepest checkpoint
        want = prefill(model, doc[:128], step=32)[0]
        assert_same_state(live_state(hit.cache), live_state(want))
        la, _ = continue_run(model, hit.cache, prompt[128:])
        lb, _ = continue_run(model, want, prompt[128:])
        assert [raw(x) for x in la] == [raw(x) for x in lb]
        assert store.check() == []


def test_none_fields_and_zero_rows_round_trip_as_themselves(tmp_path: Path) -> None:
    from tests.golden.cases import _deepseek_v4

    cache = _deepseek_v4()
    persist.save_file(tmp_path / "f.safetensors", [cache], list(range(12)))
    (back,) = persist.load_file(tmp_path / "f.safetensors").cache
    assert back.index_k is None and cache.index_k is None
    for name in ("window", "compress_kv", "pending_kv", "pending_gate"):
        a, b = getattr(back, name), getattr(cache, name)
        assert (a.shape, a.dtype, raw(a)) == (b.shape, b.dtype, raw(b)), name
    assert back.pending_kv.shape == (1, 0, 32) and back.offset == 12 and back.window_size == 8
