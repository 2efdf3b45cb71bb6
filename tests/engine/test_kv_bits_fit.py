"""A kv_bits identity whose group size the model's head dims do not divide (or whose
bits MLX cannot quantize to) describes caches that can never exist: where such an
identity meets the model, ``persist.prefill`` and ``persist serve``'s model loader
refuse it with InvalidArgumentError before a prompt token is run.  An outside attack
got mlx's bare ValueError from ``prefill`` once the prompt reached
quantized_kv_start, after a checkpoint had been saved."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import NO_KV_BITS_HERE, ON_CUDA, tokens_for

pytestmark = pytest.mark.skipif(ON_CUDA, reason=NO_KV_BITS_HERE)


def identity(tiny: Any, variant: str, **cache_config: Any) -> tuple[Any, persist.ModelIdentity]:
    model, tok, _ = tiny(variant)
    return model, persist.ModelIdentity.of(model, tok, **cache_config)


UNFIT = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 20}  # llama: heads of 16


def test_prefill_under_a_group_the_heads_do_not_divide_is_a_typed_error(
    tiny: Any, tmp_path: Path
) -> None:
    model, ident = identity(tiny, "llama", **UNFIT)
    store = persist.Store(tmp_path / "s")
    with store, pytest.raises(persist.InvalidArgumentError, match="kv_group_size=32"):
        persist.prefill(
            model, tokens_for(64), store=store, identity=ident, session="d", checkpoint_every=16
        )


def test_prefill_under_a_group_the_heads_do_not_divide_saves_nothing(
    tiny: Any, tmp_path: Path
) -> None:
    model, ident = identity(tiny, "llama", **UNFIT)
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.PersistError):
            persist.prefill(
                model, tokens_for(64), store=store, identity=ident, session="d",
                checkpoint_every=16,
            )  # fmt: skip
        assert store.entries() == []  # the checkpoint at 16 came before mlx's error


def test_prefill_under_bits_mlx_cannot_quantize_to_is_a_typed_error(tiny: Any) -> None:
    model, ident = identity(tiny, "llama_hd64", kv_bits=7, kv_group_size=32)
    with pytest.raises(persist.InvalidArgumentError, match="kv_bits=7"):
        persist.prefill(model, tokens_for(8), identity=ident)


def test_prefill_under_a_group_that_fits_quantizes(tiny: Any) -> None:
    model, ident = identity(tiny, "llama_hd64", **UNFIT)
    cache = persist.prefill(model, tokens_for(40), identity=ident)
    assert {type(c).__name__ for c in cache} == {"QuantizedKVCache"}


def test_the_server_refuses_a_group_the_heads_do_not_divide_when_it_loads(
    tiny: Any,
) -> None:
    """persist serve's loader: the options are refused at load (at start for the
    default model), not answered with a 500 per request."""
    from mlx_lm import load

    from persist.serve.model_identity import track_identities

    d = tiny("llama")[2]

    class Provider:
        cli_args = types.SimpleNamespace(kv_bits=4, kv_group_size=32, quantized_kv_start=20)
        draft_model = None

        def _load(self, path: Any, adapter: Any = None, draft: Any = None) -> None:
            self.model, self.tokenizer = load(path)[:2]
            self.model_key = (path, adapter, draft)

        def reset(self) -> None:  # mlx-lm's: what the refusal leaves loaded is dropped
            self.model_key = self.model = None

    track_identities(types.SimpleNamespace(ModelProvider=Provider))
    provider = Provider()
    with pytest.raises(persist.InvalidArgumentError, match="kv_group_size=32"):
        provider._load(str(d))
    assert provider.model_key is None  # the next request loads (and is refused) again
