"""Which models a request may name: those the operator allowed, compared as text only.

mlx-lm loads whatever a request's ``model`` (and ``draft_model``, ``adapters``)
names: any folder the server can read, and its error told the client whether
files exist there (``No such file or directory: '/etc/config.json'``).  Here
a request may name only the served model (``default_model``, the name
``--model`` was given as, its folder) or what ``--allowed-models`` lists; any
other name is refused with one message whatever it names, before anything
touches the filesystem: a client's string is never a path persist opens,
resolves or stats.  A name of the served model is rewritten to
``default_model``, mlx-lm's key for it, so no second copy is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .request_checks import BadRequest

__all__ = ["AllowedModels", "ModelRefused", "DEFAULT", "listing_only"]

DEFAULT = "default_model"  # mlx-lm's name of the model it was started with


class ModelRefused(BadRequest):
    """A request naming a model this server does not serve (404, as OpenAI answers)."""

    status = 404

    def body(self) -> dict[str, Any]:
        got = super().body()
        got["error"]["code"] = "model_not_found"
        return got


@dataclass(frozen=True)
class AllowedModels:
    """The served model's names (``served``) and the further models an operator allowed
    (``extra``: folders or Hugging Face repo ids, passed to mlx-lm as they are)."""

    served: frozenset[str] = frozenset({DEFAULT})
    extra: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, served: Iterable[str | None], extra: Iterable[str] = ()) -> AllowedModels:
        names = {DEFAULT, *(s for s in served if s)}
        return cls(frozenset(names), frozenset(e for e in extra if e) - names)

    def names(self) -> list[str]:
        """Every name a request may give, sorted (what ``/v1/models`` may list)."""
        return sorted((self.served - {DEFAULT}) | self.extra)

    def admit(self, body: dict[str, Any]) -> bool:
        """Raise ModelRefused for a model, draft model or adapter not allowed; rewrite a
        name of the served model to ``default_model``.  True if ``body`` changed."""
        changed = False
        for key in ("model", "draft_model"):
            name = body.get(key)
            if name is None:
                continue
            if name in self.served:
                changed |= name != DEFAULT
                body[key] = DEFAULT
            elif name not in self.extra:
                raise self._refused(key, name)
        adapter = body.get("adapters")
        if adapter is not None and adapter not in self.extra:
            raise self._refused("adapters", adapter)
        return changed

    def _refused(self, key: str, name: Any) -> ModelRefused:
        # the same words for every name: nothing says whether a path exists
        shown = name if len(name) <= 200 else name[:200] + "..."
        return ModelRefused(
            f"{key} {shown!r} is not served here; this server serves only the models its "
            "operator allowed (--allowed-models)",
            key,
        )


def listing_only(scan: Any, allowed: AllowedModels) -> Any:
    """mlx-lm's ``scan_cache_dir`` for GET /v1/models that lists only the cached repos a
    request may name: the rest of the Hugging Face cache is not this server's to show."""
    from types import SimpleNamespace

    names = set(allowed.names())

    def scan_cache_dir(*args: Any, **kwargs: Any) -> Any:
        found = scan(*args, **kwargs)
        return SimpleNamespace(repos=[r for r in found.repos if r.repo_id in names])

    return scan_cache_dir
