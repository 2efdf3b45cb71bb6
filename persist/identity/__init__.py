"""ModelIdentity: everything that must match for a cached state to mean the same.

A cache is only valid for the exact model that computed it: config (RoPE
settings included), weights, what every module computes with beside its
weights (``modules``: classes, plain settings, arrays that are not
parameters), tokenizer, chat template and the cache configuration (kv_bits,
group size, quantized_kv_start, max_kv_size).  Library versions are recorded
but are not part of the digest.  What a loaded model says about itself (its
configuration, weights, tokenizer, cache layout, backend) is read by
``identity.model_facts``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import provenance
from ..errors import IdentityMismatchError, InvalidArgumentError, InvalidMetadataError
from .model_facts import (
    Window,
    cache_layout,
    canonical,
    config_digest,
    current_backend,
    sha,
    tokenizer_digests,
    weights_of,
)

__all__ = ["ModelIdentity", "CACHE_CONFIG_KEYS", "backend_kind", "config_digest"]

CACHE_CONFIG_KEYS = ("kv_bits", "kv_group_size", "quantized_kv_start", "max_kv_size")
DIGEST_FIELDS = ("model_type", "config", "weights", "tokenizer", "chat_template", "cache_config")
# Digested only when set, so identities written before they existed keep their digest
# (and, since ``of`` always sets ``modules``, never equal one made now: a miss).
OPTIONAL_FIELDS = ("draft", "modules")


def _cache_config(cfg: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    unknown = set(cfg) - set(CACHE_CONFIG_KEYS)
    if unknown:
        raise InvalidMetadataError(
            f"unknown cache configuration {sorted(unknown)}; known: {list(CACHE_CONFIG_KEYS)}"
        )
    out = []
    for k in CACHE_CONFIG_KEYS:
        v = cfg.get(k)
        if v is None:
            continue
        if type(v) is not int or v < 0:
            raise InvalidMetadataError(
                f"cache configuration {k} must be a non-negative int, got {v!r}"
            )
        out.append((k, v))
    if cfg.get("kv_bits") is None:
        # Without kv_bits the quantization settings change nothing.
        out = [(k, v) for k, v in out if k == "max_kv_size"]
    return tuple(sorted(out))


def backend_kind(backend: str) -> str:
    """ "cuda" of "cuda:NVIDIA H200"; "" when unknown."""
    return backend.split(":", 1)[0]


@dataclass(frozen=True)
class ModelIdentity:
    """What must match to resume.  Equal iff every digested field is equal."""

    model_type: str
    config: str
    weights: str
    tokenizer: str
    chat_template: str
    cache_config: tuple[tuple[str, int], ...] = ()
    name: str = field(default="", compare=False)
    versions: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # The digest of a speculative draft model whose caches ride in the same
    # cache list (mlx-lm's server appends them): another draft, another cache.
    draft: str = ""
    # every module's class and non-parameter state (``provenance.modules_digest``):
    # a RoPE or an attention scale replaced in code is another model.  Empty only in
    # identities of persist before it existed (their caches are misses now)
    modules: str = ""
    # where the cache was computed ("cpu", "metal", "cuda"): not digested, since the
    # state is valid anywhere; Store(strict_backend=True) refuses another backend's
    backend: str = field(default="", compare=False)
    # how many layers the model's own make_prompt_cache makes (0: unknown): not
    # digested; a save of a cache list of another length is refused
    layers: int = field(default=0, compare=False)
    # (layer, max_size, keep) of every ring those caches hold, under the identity's
    # max_kv_size: not digested (the config and max_kv_size decide it); None:
    # unknown (an identity made by hand or by a persist before it), no claim
    windows: tuple[Window, ...] | None = field(default=None, compare=False)
    # the folder persist loaded the model from, as ``mlx_lm --model`` accepts it (an
    # mlx-lm export claims it): not digested; "" when unknown
    source: str = field(default="", compare=False)

    def _digested(self) -> tuple[str, ...]:
        return DIGEST_FIELDS + tuple(k for k in OPTIONAL_FIELDS if getattr(self, k))

    @property
    def digest(self) -> str:
        return sha(canonical({k: getattr(self, k) for k in self._digested()}))

    def with_draft(self, draft: ModelIdentity | None) -> ModelIdentity:
        """This identity for a cache list that also holds ``draft``'s caches."""
        return dataclasses.replace(self, draft=draft.digest if draft is not None else "")

    @classmethod
    def of(
        cls,
        model: Any,
        tokenizer: Any = None,
        *,
        name: str | None = None,
        path: str | os.PathLike[str] | None = None,
        adapter_path: str | os.PathLike[str] | None = None,
        source: str | None = None,
        **cache_config: Any,
    ) -> ModelIdentity:
        """The identity of a loaded mlx-lm model (and its tokenizer).

        Every weight is hashed (about 0.2 s per GiB) unless persist loaded the
        model from ``path`` (and ``adapter_path``) itself (``from_path``, the
        CLI, ``persist serve``, ``provenance.load_model``) and it still holds
        every array it was loaded with, in modules unchanged: then the digest
        remembered for those files is used (``provenance``).  A model cast,
        quantized, fused with an adapter or updated after loading is hashed.
        Not seen: a write into a weight array in place (``w[...] = x``, ``w += x``), which
        keeps the array object; code that edits weights so passes no ``path``.
        ``source`` (recorded, not digested): where mlx-lm finds the model; ``path``
        made absolute unless given.
        """
        model_type, config = config_digest(model)
        tok, template = tokenizer_digests(tokenizer)
        cfg = _cache_config(cache_config)
        layers, windows = cache_layout(model, dict(cfg).get("max_kv_size"))
        return cls(
            model_type=model_type,
            config=config,
            weights=weights_of(model, path, adapter_path),
            modules=provenance.modules_digest(model),  # never remembered: cheap, and in memory
            tokenizer=tok,
            chat_template=template,
            cache_config=cfg,
            name=name or model_type,  # one display rule: the model_type unless named
            versions=tuple(sorted(provenance.versions().items())),
            backend=current_backend(),
            layers=layers,
            windows=windows,
            source=_source(source, path),
        )

    @classmethod
    def from_path(
        cls,
        model_dir: str | os.PathLike[str],
        *,
        adapter_path: str | os.PathLike[str] | None = None,
        **cache_config: Any,
    ) -> ModelIdentity:
        """The identity of the mlx-lm model directory ``model_dir`` (with its LoRA adapter).

        Loads the model lazily with mlx-lm, so it equals ``of()`` of the same
        model as mlx-lm loads it (sanitized weights, adapter weights included).
        """
        path = Path(model_dir)
        adapter = None if adapter_path is None else str(adapter_path)
        model, tokenizer = provenance.load_model(path, adapter, lazy=True)[:2]
        return cls.of(model, tokenizer, path=path, adapter_path=adapter, **cache_config)

    def diff(self, other: ModelIdentity) -> list[str]:
        """The digested fields that differ, by name (cache_config per key)."""
        out = []
        for k in DIGEST_FIELDS + OPTIONAL_FIELDS:
            if k == "cache_config":
                mine, theirs = dict(self.cache_config), dict(other.cache_config)
                out += [
                    f"cache_config.{c}"
                    for c in sorted(set(mine) | set(theirs))
                    if mine.get(c) != theirs.get(c)
                ]
            elif getattr(self, k) != getattr(other, k):
                out.append(k)
        return out

    def require_same(self, other: ModelIdentity, what: str) -> None:
        """Refuse ``other`` unless it equals this (saved) identity, naming both models."""
        fields = self.diff(other)
        if fields:
            raise IdentityMismatchError(what, fields, self.display(), other.display())

    def display(self) -> str:
        """The one display rule: the model's name and the start of its digest."""
        return f"{self.name or self.model_type} {self.digest[:12]}"

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self._digested() if k != "cache_config"}
        return {
            **d,
            "cache_config": dict(self.cache_config),
            "name": self.name,
            "versions": dict(self.versions),
            "digest": self.digest,
            **({"backend": self.backend} if self.backend else {}),
            **({"layers": self.layers} if self.layers else {}),
            **({"windows": [list(w) for w in self.windows]} if self.windows is not None else {}),
            **({"source": self.source} if self.source else {}),
        }

    @classmethod
    def from_dict(cls, d: Any) -> ModelIdentity:
        """Inverse of ``to_dict``; ValueError on anything malformed."""
        if not isinstance(d, dict):
            raise InvalidArgumentError("identity must be a map")
        strs: dict[str, str] = {}
        for k in ("model_type", "config", "weights", "tokenizer", "chat_template", "name"):
            v = d.get(k)
            if not isinstance(v, str) or len(v) > 4096:
                raise InvalidArgumentError(f"identity field {k} must be a string")
            strs[k] = v
        draft, backend, modules = d.get("draft", ""), d.get("backend", ""), d.get("modules", "")
        source = d.get("source", "")
        texts = (draft, backend, modules, source)
        if not all(isinstance(v, str) and len(v) <= 4096 for v in texts):
            raise InvalidArgumentError(
                "identity fields draft, modules, backend and source must be strings"
            )
        layers = d.get("layers", 0)
        if type(layers) is not int or not 0 <= layers <= 1 << 20:
            raise InvalidArgumentError("identity field layers must be a small int")
        windows = _windows_of(d.get("windows"))
        cc, ver = d.get("cache_config"), d.get("versions", {})
        if not isinstance(cc, dict) or not isinstance(ver, dict):
            raise InvalidArgumentError("identity cache_config and versions must be maps")
        ident = cls(
            model_type=strs["model_type"],
            config=strs["config"],
            weights=strs["weights"],
            tokenizer=strs["tokenizer"],
            chat_template=strs["chat_template"],
            cache_config=tuple(sorted((str(k), v) for k, v in cc.items())),
            name=strs["name"] or "",
            versions=tuple(sorted((str(k), str(v)) for k, v in ver.items())),
            draft=draft,
            modules=modules,
            backend=backend,
            layers=layers,
            windows=windows,
            source=source,
        )
        if d.get("digest") != ident.digest:
            raise InvalidArgumentError("identity digest does not match its fields")
        return ident


def _windows_of(raw: Any) -> tuple[Window, ...] | None:
    """An identity map's ``windows``: None when absent (unknown), else (layer, size, keep)
    triples of small non-negative ints."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > 1 << 20:
        raise InvalidArgumentError("identity field windows must be a list")
    out = []
    for w in raw:
        if (
            not isinstance(w, list)
            or len(w) != 3
            or not all(type(x) is int and 0 <= x < 1 << 40 for x in w)
        ):
            raise InvalidArgumentError("identity windows must be [layer, max_size, keep] ints")
        out.append((w[0], w[1], w[2]))
    return tuple(out)


def _source(source: str | None, path: str | os.PathLike[str] | None) -> str:
    if source is not None:
        return source
    return str(Path(path).absolute()) if path is not None else ""
