"""Which model identity each model mlx-lm's server loads gets (``persist serve``).

The server's ModelProvider loads models itself; ``track_identities`` wraps its
loader so each model is stamped with its load provenance right after mlx-lm
loaded it (``provenance.stamp``: its identity may use the remembered weights
digest) and its identity is kept by the server's model key.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import provenance
from ..engine.cache_fit import refuse_unfit_kv_bits
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from .drafts import draft_problem

__all__ = ["cache_config_of", "track_identities"]


def cache_config_of(cli_args: Any) -> dict[str, int]:
    """The server options that change the caches it computes (kv_bits and its settings)."""
    if getattr(cli_args, "kv_bits", None) is None:
        return {}
    return {
        "kv_bits": int(cli_args.kv_bits),
        "kv_group_size": int(cli_args.kv_group_size),
        "quantized_kv_start": int(cli_args.quantized_kv_start),
    }


def track_identities(
    server: Any,
    by_model: dict[int, ModelIdentity] | None = None,
    on_load: Callable[[ModelIdentity], None] | None = None,
) -> dict[Any, ModelIdentity]:
    """Patch mlx-lm's ModelProvider so each model it loads gets its identity.

    Keyed by the server's own model key (model path, adapter path, draft
    path); the identity digests the weights as loaded (adapter included),
    the draft model whose caches ride in the same list, and the kv-bits
    options.  Host, port, logging and sampling options change no cache.
    """
    identities: dict[Any, ModelIdentity] = {}
    real_load = server.ModelProvider._load

    def _load(self: Any, model_path: Any, adapter_path: Any = None, draft: Any = None) -> None:
        real_load(self, model_path, adapter_path, draft)
        try:
            _track(self, model_path, adapter_path)
        except BaseException:
            # what cannot be served is not kept loaded: the next request for it would
            # find its key loaded and be served with no identity, or served wrong
            self.reset()
            raise

    def _track(self: Any, model_path: Any, adapter_path: Any) -> None:
        problem = draft_problem(self.model, self.draft_model)
        if problem is not None:
            raise InvalidArgumentError(problem)
        config: dict[str, Any] = cache_config_of(self.cli_args)
        # local directories let the weights digest be remembered across restarts:
        # stamped now, before any code but mlx-lm's loader touched the model (an
        # adapter from elsewhere is in no file the memo keys; a distributed load
        # holds this rank's shard: both hashed, never remembered)
        local = [
            p if p is not None and Path(str(p)).is_dir() else None
            for p in (model_path, adapter_path)
        ]
        files = local[0] is not None and (adapter_path is None) == (local[1] is None)
        if files and not getattr(self, "is_distributed", False):
            provenance.stamp(self.model, str(local[0]), local[1])
        ident = ModelIdentity.of(
            self.model,
            self.tokenizer,
            path=local[0],
            adapter_path=local[1],
            source=None if local[0] is not None else _snapshot(model_path),
            **config,
        )
        refuse_unfit_kv_bits(self.model, ident)  # mlx-lm would fail mid-prompt: a 500
        if self.draft_model is not None:
            ident = ident.with_draft(ModelIdentity.of(self.draft_model))
        identities[self.model_key] = ident
        if by_model is not None:  # what the server's generators see: the model object
            by_model[id(self.model)] = ident
        if on_load is not None:  # persist serve --warm: this model's entries into RAM
            on_load(ident)

    server.ModelProvider._load = _load
    return identities


def _snapshot(model_path: Any) -> str:
    """The Hugging Face cache folder mlx-lm loaded a repo id from ("" if none): what
    an mlx-lm export of its sessions claims (``ModelIdentity.source``)."""
    from ..apps.hub import resolve_model

    try:
        return str(resolve_model(str(model_path), download=False).absolute())
    except Exception:  # a distributed or otherwise unusual load: no folder to name
        return ""
