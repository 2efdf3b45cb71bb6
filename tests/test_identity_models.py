"""Every model type mlx-lm ships gets an identity that covers its configuration.

Round 1 read the config from ``model.args`` only: models that keep it as
``model.config`` got a digest of their class name, so two configurations
shared caches.  Here every model module is built with tiny sizes where
generic arguments allow, and one float field (rope_theta, an epsilon, ...)
is changed: the config digest must change.  Modules that need arguments no
generic filler guesses are checked in their source: the Model class keeps its
arguments under a name the identity reads.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing
from typing import Any

import mlx.nn as nn
import mlx_lm.models as models
import pytest

from persist import ModelIdentity
from persist.errors import IdentityUnavailableError, PersistError
from persist.identity.model_facts import CONFIG_ATTRS, config_digest

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "layer_norm_eps": 1e-5,
}


def module_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(models.__path__))


def model_module(name: str) -> Any:
    try:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
    except BaseException:  # a model that needs an optional package (olmo exits)
        return None
    if not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")):
        return None
    return mod


def filled(cls: Any, name: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {k: v for k, v in BASE.items() if k in fields}
    for f in fields.values():
        if f.name in out or f.default is not dataclasses.MISSING:
            continue
        if f.default_factory is not dataclasses.MISSING:
            continue
        t, s = hints.get(f.name), str(hints.get(f.name))
        if t is int:
            out[f.name] = 2
        elif t is float:
            out[f.name] = 1.0
        elif t is bool:
            out[f.name] = False
        elif t is str:
            out[f.name] = "x"
        elif "ist" in s:
            out[f.name] = []
        elif "ict" in s:
            out[f.name] = {}
        else:
            out[f.name] = None
    out["model_type"] = name
    return out


def build(mod: Any, cfg: dict[str, Any]) -> Any:
    try:
        return mod.Model(mod.ModelArgs.from_dict(cfg))
    except Exception:
        return None


def float_field(args: Any) -> str | None:
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        if type(v) is float and v != 0:
            return f.name
    return None


def keeps_args_where_identity_reads(cls: type) -> bool:
    """Some class of the Model's MRO stores its first __init__ argument as self.<attr>."""
    for klass in cls.__mro__:
        if klass is nn.Module or not klass.__module__.startswith("mlx_lm"):
            continue
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters)
        if len(params) < 2:
            continue
        stored = re.findall(rf"self\.(\w+) = {params[1]}\b", inspect.getsource(init))
        if stored:
            return any(a in CONFIG_ATTRS for a in stored)
    return False


@pytest.mark.parametrize("name", module_names())
def test_one_config_field_changes_the_identity(name: str) -> None:
    mod = model_module(name)
    if mod is None:
        return  # not a model (cache, layers, helpers) or one this machine cannot import
    cfg = filled(mod.ModelArgs, name)
    a = build(mod, cfg)
    field = float_field(a.args if a is not None and hasattr(a, "args") else a.config) if a else None
    if a is None or field is None:
        assert keeps_args_where_identity_reads(mod.Model), f"{name}: config kept elsewhere"
        return
    b = build(mod, {**cfg, field: getattr(getattr(a, "args", None) or a.config, field) * 2})
    assert b is not None
    assert config_digest(a) != config_digest(b), f"{name}: {field} is not in the identity"


def test_a_model_without_configuration_is_refused() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(IdentityUnavailableError) as e:
        ModelIdentity.of(Bare())
    assert isinstance(e.value, PersistError) and isinstance(e.value, ValueError)


def test_models_that_keep_config_as_config(tmp_path: Any) -> None:
    """youtu_llm keeps ModelArgs as self.config: rope_theta must reach its identity."""
    mod = importlib.import_module("mlx_lm.models.youtu_llm")
    cfg = filled(mod.ModelArgs, "youtu_llm")
    a, b = build(mod, cfg), build(mod, {**cfg, "rope_theta": 20000.0})
    assert a is not None and b is not None and not hasattr(a, "args")
    assert config_digest(a) != config_digest(b)
