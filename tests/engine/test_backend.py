"""The identity records the backend that computed a cache (not digested: the state is
valid anywhere); Store(strict_backend=True) refuses caches another backend computed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.identity import backend_kind
from persist.identity.model_facts import current_backend
from tests.helpers import another_backend, prefill, tokens_for


def test_the_backend_is_recorded_and_not_digested(tiny: Any) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    assert ident.backend == current_backend()
    assert backend_kind(ident.backend) in ("cpu", "metal", "cuda")
    assert ident.backend.startswith(backend_kind(ident.backend) + ":")  # and the device
    other = dataclasses.replace(ident, backend="cuda:NVIDIA H200")
    assert other == ident and other.digest == ident.digest
    back = persist.ModelIdentity.from_dict(other.to_dict())
    assert back.backend == "cuda:NVIDIA H200" and back == ident
    old = {k: v for k, v in ident.to_dict().items() if k != "backend"}  # round 1's rows
    assert persist.ModelIdentity.from_dict(old).backend == ""


def test_strict_stores_refuse_another_backends_caches(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    here = persist.ModelIdentity.of(model, tok)
    there = dataclasses.replace(here, backend=another_backend(here.backend))
    toks = tokens_for(300, seed=60)
    with persist.Store(tmp_path / "s") as store:
        store.save(prefill(model, toks)[0], toks, identity=there, session="gpu")
        assert store.restore("gpu", identity=here).tokens == toks  # allowed by default
        assert store.lookup([*toks, 1], identity=here) is not None
    with persist.Store(tmp_path / "s", strict_backend=True) as strict:
        with pytest.raises(persist.IdentityMismatchError, match="backend"):
            strict.restore("gpu", identity=here)
        assert strict.lookup([*toks, 1], identity=here) is None
        assert strict.restore("gpu", identity=there).tokens == toks


def test_strict_compares_the_backend_not_the_device(tiny: Any, tmp_path: Path) -> None:
    """Another GPU of the same backend is the same backend (the device is informational)."""
    model, tok, _ = tiny("llama")
    here = persist.ModelIdentity.of(model, tok)
    same_kind = dataclasses.replace(here, backend=backend_kind(here.backend) + ":another chip")
    toks = tokens_for(300, seed=61)
    with persist.Store(tmp_path / "s", strict_backend=True) as strict:
        strict.save(prefill(model, toks)[0], toks, identity=same_kind, session="s")
        assert strict.restore("s", identity=here).tokens == toks
        assert strict.lookup([*toks, 1], identity=here) is not None
