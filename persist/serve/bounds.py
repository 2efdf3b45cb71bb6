"""How many tokens one request may ask for: the operator's limit and the model's context.

mlx-lm checks ``max_tokens`` for its type only: ``100000000`` was taken and
generated until the client's patience or the machine's memory ran out.  A
request asking for more than ``--max-tokens-limit`` is refused (400, the
field named); one asking for more than the model's context leaves room for
is cut to what fits (``capped``), and a prompt that fills the context alone
is refused.  Pure: no mlx, no HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .allowed_models import AllowedModels
from .request_checks import BadRequest

__all__ = [
    "DEFAULT_MAX_TOKENS_LIMIT", "RequestLimits", "capped", "check_max_tokens", "context_length",
    "limits_for",
]  # fmt: skip

DEFAULT_MAX_TOKENS_LIMIT = 32768
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this server beyond its fields' types (the handler's)."""

    max_tokens: int = DEFAULT_MAX_TOKENS_LIMIT
    models: AllowedModels = field(default_factory=AllowedModels)

    def admit(self, body: dict[str, Any]) -> bool:
        """Raise BadRequest (or ModelRefused) for what is past the limits; True if a
        model's name in ``body`` was rewritten (``AllowedModels.admit``)."""
        check_max_tokens(body, self.max_tokens)
        return self.models.admit(body)


def limits_for(
    model_dir: str, names: Iterable[str], allowed: Iterable[str], max_tokens: int | None
) -> RequestLimits:
    """The limits of a server of ``model_dir`` (also known as ``names``: what ``--model``
    was given as) and the further ``allowed`` models; the folder's resolved path is a
    name too (what ``/v1/models`` lists), worked out here from the operator's path."""
    served = [model_dir, *names]
    with contextlib.suppress(OSError):
        served.append(str(Path(model_dir).resolve()))
    return RequestLimits(
        DEFAULT_MAX_TOKENS_LIMIT if max_tokens is None else max_tokens,
        AllowedModels.of(served, allowed),
    )


def check_max_tokens(body: dict[str, Any], limit: int) -> None:
    """BadRequest for a token count above ``limit`` (types are checked before this)."""
    for name in TOKEN_FIELDS:
        n = body.get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > limit:
            raise BadRequest(
                f"{name} is {n}; this server generates at most {limit} tokens a request "
                "(--max-tokens-limit)",
                name,
            )


def context_length(model: Any) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), None when unstated.

    A value that is only the default of mlx-lm's ``ModelArgs`` counts as unstated:
    mamba2's args default to 2056 whatever its config says (nothing), and a
    recurrent model has no position limit to enforce."""
    args = getattr(model, "args", None)
    for holder in (args, getattr(args, "text_config", None)):
        n = (
            holder.get("max_position_embeddings")
            if isinstance(holder, dict)
            else getattr(holder, "max_position_embeddings", None)
        )
        if isinstance(n, int) and not isinstance(n, bool) and n > 0 and not _default(holder, n):
            return n
    return None


def _default(holder: Any, n: int) -> bool:
    """Is ``n`` the dataclass default of ``holder``'s ``max_position_embeddings``?"""
    if not dataclasses.is_dataclass(holder):
        return False
    for f in dataclasses.fields(holder):
        if f.name == "max_position_embeddings":
            return f.default is not dataclasses.MISSING and f.default == n
    return False


def capped(max_tokens: int, prompt_tokens: int, context: int | None) -> int:
    """``max_tokens`` cut so that prompt and answer fit the context; BadRequest for a
    prompt that leaves no room for one token."""
    if context is None:
        return max_tokens
    room = context - prompt_tokens
    if room < 1:
        raise BadRequest(
            f"the prompt is {prompt_tokens} tokens; this model's context is {context} tokens "
            "and leaves no room for an answer",
            None,
        )
    return min(max_tokens, room)
