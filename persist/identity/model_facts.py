"""What a loaded model says about itself, for its ``ModelIdentity``.

Its configuration wherever the model keeps it, its weights' digest (the
remembered one when ``provenance`` vouches for it), its tokenizer and chat
template, the layers and rings of the caches mlx-lm makes for it, and the
backend computing here.  ``identity.ModelIdentity.of`` records them; nothing
here is part of the record itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from .. import provenance
from ..errors import IdentityUnavailableError

__all__ = [
    "CONFIG_ATTRS",
    "RING_CLASSES",
    "Window",
    "cache_layout",
    "canonical",
    "config_digest",
    "current_backend",
    "sha",
    "tokenizer_digests",
    "weights_of",
]


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def current_backend() -> str:
    """The MLX backend and device computing here: "cuda:NVIDIA H200", "metal:Apple M2
    Max", "cpu:..." (the part before the colon is what ``strict_backend`` compares)."""
    import mlx.core as mx

    if mx.default_device().type != mx.gpu:
        kind = "cpu"
    else:
        cuda = getattr(mx, "cuda", None)
        kind = "cuda" if cuda is not None and cuda.is_available() else "metal"
    try:
        name = str(mx.device_info().get("device_name", ""))
    except Exception:  # an MLX without device_info: the kind alone
        name = ""
    name = "".join(c for c in name if c.isprintable())[:120].strip()
    return f"{kind}:{name}" if name else kind


def weights_of(
    model: Any, path: str | os.PathLike[str] | None, adapter: str | os.PathLike[str] | None
) -> str:
    """The remembered digest when persist loaded ``model`` from ``path`` (and
    ``adapter``) and it still holds what was loaded (``provenance``); else every
    weight hashed, and nothing remembered: a model changed in memory never gets
    the files' digest."""
    if path is not None:
        known = provenance.remembered(model, path, adapter)
        if known is not None:
            return known
    return provenance.weights_digest(model)


Window = tuple[int, int, int]  # (layer, max_size, keep) of one ring
RING_CLASSES = ("RotatingKVCache", "BatchRotatingKVCache")


def cache_layout(model: Any, max_kv_size: int | None) -> tuple[int, tuple[Window, ...] | None]:
    """(layers, rings) of the caches mlx-lm makes for ``model`` under ``max_kv_size``
    (``make_prompt_cache``: empty caches, no compute; a model's own ``make_cache``
    ignores ``max_kv_size``); (0, None) when it cannot make them."""
    try:
        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    except Exception:
        return 0, None
    rings = [(i, *ring) for i, c in enumerate(caches) for ring in _rings(c)]
    return len(caches), tuple(rings)


def _rings(cache: Any) -> list[tuple[int, int]]:
    """(max_size, keep) of every ring in one layer's cache, a CacheList's in order."""
    if type(cache).__name__ in RING_CLASSES:
        return [(int(cache.max_size), int(getattr(cache, "keep", 0)))]
    return [r for inner in getattr(cache, "caches", ()) or () for r in _rings(inner)]


def tokenizer_digests(tokenizer: Any) -> tuple[str, str]:
    if tokenizer is None:
        return "none", "none"
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else canonical(sorted(inner.get_vocab().items()))
    special = {
        "special": sorted(getattr(inner, "all_special_tokens", []) or []),
        "eos": sorted(getattr(tokenizer, "eos_token_ids", None) or []),
        "bos": getattr(inner, "bos_token", None),
    }
    template = getattr(inner, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    return sha(body + canonical(special)), sha(canonical(template))


CONFIG_ATTRS = ("args", "config", "model_args", "model_config")


def _as_config(value: Any) -> dict[str, Any] | None:
    """A model's configuration object as a plain dict, or None if ``value`` is not one."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict) and value:
        return dict(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):  # transformers-style configs
        out = value.to_dict()
        return dict(out) if isinstance(out, dict) else None
    return None


def _config_of(model: Any) -> tuple[str, dict[str, Any]]:
    """Every configuration the model keeps, wherever it keeps it (``args``, ``config``, ...).

    mlx-lm's models keep their ModelArgs as ``self.args`` or ``self.config``
    (youtu_llm, plamo2, plamo3, baichuan_m1); any other dataclass held
    directly by the model counts too.  A model with none cannot be given an
    identity: digesting only its class name would let two configurations
    share caches.
    """
    found: dict[str, Any] = {}
    own = vars(model) if hasattr(model, "__dict__") else {}
    for name in CONFIG_ATTRS:
        cfg = _as_config(getattr(model, name, None))
        if cfg is not None:
            found[name] = cfg
    for name, value in sorted(own.items()):
        if name not in found and dataclasses.is_dataclass(value) and not isinstance(value, type):
            found[name] = dataclasses.asdict(value)
    if not found:
        t = type(model)
        raise IdentityUnavailableError(
            f"{t.__module__}.{t.__qualname__} keeps no configuration persist can find "
            f"(looked at {', '.join(CONFIG_ATTRS)} and its dataclass attributes); "
            "pass the model mlx-lm loaded, or give it an 'args' attribute"
        )
    first = next(iter(found.values()))
    model_type = next(
        (str(c["model_type"]) for c in found.values() if c.get("model_type")),
        type(model).__module__,
    )
    # one configuration under 'args' digests exactly as before (identities stay stable)
    cfg = first if list(found) == ["args"] else {"class": type(model).__qualname__, **found}
    return model_type, cfg


def config_digest(model: Any) -> tuple[str, str]:
    """(model_type, digest of every configuration the model keeps)."""
    model_type, cfg = _config_of(model)
    return model_type, sha(canonical(cfg))
