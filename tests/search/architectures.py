"""Every architecture mlx-lm ships, built tiny, for the state-space search.

``module_names()`` enumerates ``mlx_lm.models`` (pkgutil), so an architecture
mlx-lm adds is searched (or named in ``SKIPPED``) without editing this file's
list.  ``config_for(name)`` fills the module's ``ModelArgs`` with tiny sizes:
one generic map of common field names, what each field's type needs when it
has no default, and a few per-module overrides where a model reads fields no
generic value fits (tests/search/arch_args.py, which also names the skipped
modules, each with its reason, in ``SKIPPED``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

import mlx.core as mx
import mlx_lm.models as models
from mlx_lm.models.cache import CacheList, make_prompt_cache

from tests.search.arch_args import GENERIC, OVERRIDES, SKIPPED, TEXT_ARGS


def module_names() -> list[str]:
    """Every module in mlx_lm.models."""
    return sorted(m.name for m in pkgutil.iter_modules(models.__path__))


def searched() -> list[str]:
    """The modules the search builds: every one not in SKIPPED (read from the package
    listing only, so collecting the tests imports no model)."""
    return [n for n in module_names() if n not in SKIPPED]


def model_module(name: str) -> Any:
    """The module when it is a model (it has Model and ModelArgs), else None."""
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    if not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")):
        return None
    return mod


def _needed(hint: Any) -> Any:
    """A tiny value for a required field of type ``hint``."""
    s = str(hint)
    if hint is int:
        return 2
    if hint is float:
        return 1.0
    if hint is bool:
        return False
    if hint is str:
        return "x"
    if "ist" in s or "uple" in s:
        return []
    if "ict" in s:
        return {}
    return None


def _fits(value: Any, hint: Any) -> bool:
    """Whether a generic value suits a field's type (an int is no str pattern)."""
    if hint is None or hint is Any:
        return True
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        return any(_fits(value, a) for a in args if a is not type(None))
    origin = typing.get_origin(hint) or hint
    if not isinstance(origin, type):
        return True
    if origin is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin)


def filled(cls: Any, model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """A tiny config dict for the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if f.name in GENERIC and _fits(GENERIC[f.name], hint):
            out[f.name] = GENERIC[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            out[f.name] = _needed(hint)
    out["model_type"] = model_type
    out.update(overrides)
    return out


def config_for(name: str, mod: Any) -> dict[str, Any]:
    """A tiny config dict for module ``name``'s ModelArgs."""
    out = filled(mod.ModelArgs, name, OVERRIDES.get(name, {}))
    if name in TEXT_ARGS:
        module, cls = TEXT_ARGS[name].split(".")
        text = getattr(importlib.import_module(f"mlx_lm.models.{module}"), cls)
        out["text_config"] = filled(text, module, OVERRIDES.get(module, {}))
    return out


def build(name: str, seed: int = 0) -> Any:
    """Module ``name``'s model with tiny arguments and random float32 weights."""
    mod = model_module(name)
    if mod is None:
        raise ValueError(f"{name} is not a model module")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(config_for(name, mod)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    if not make_prompt_cache(model):
        raise ValueError(f"{name} built with no cached layers: its config needs overrides")
    return model


def signature(model: Any) -> tuple[str, ...]:
    """The model's cache classes, one per layer kind (CacheList with its parts): the
    combination the search groups architectures by."""

    def name(c: Any) -> str:
        if isinstance(c, CacheList):
            return f"CacheList({','.join(name(x) for x in c.caches)})"
        return type(c).__name__

    return tuple(sorted({name(c) for c in make_prompt_cache(model)}))
