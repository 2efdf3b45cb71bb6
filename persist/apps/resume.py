"""Where a turn starts: the session as saved, or the longest stored prefix; and where
it ends: saved only over the version it started from.

A text session appends the prompt's tokens to the session's.  A chat session
(``--chat``) keeps its messages in the session's metadata and renders them
with the tokenizer's chat template each turn; when the rendering extends the
stored tokens, only the new turn is prefilled, otherwise the longest stored
prefix of the rendering is used (correct, just less reuse), and a new chat
that starts with the same system prompt reuses another chat's prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..engine.store import Store
from ..engine.unverified import UNVERIFIED_KEY
from ..errors import (
    InvalidArgumentError,
    InvalidMetadataError,
    SessionConflictError,
    SessionNotFoundError,
)
from ..format.manifest import MAX_USER_METADATA
from ..identity import ModelIdentity
from ..records import Progress
from ..storage.rows import MAX_FORKS, fork_name

__all__ = ["Resumed", "resume_text", "resume_chat", "save_turn", "CHAT_KEY"]

CHAT_KEY = "persist.chat"  # session metadata: the chat's messages, as JSON
ANSWER_ROOM = 256 << 10  # metadata kept free for the answer a turn adds


@dataclass(frozen=True, kw_only=True)
class Resumed:
    cache: list[Any] | None
    tokens: list[int]  # every token of this turn, the session's history included
    covered: int  # of those, restored from the store
    source: str  # "session", "prefix" or "none"
    version: int  # the session's version read (0: none): the save checks it is unchanged
    unverified: bool = False  # the restored session's tokens are unverified: so is the turn


def resume_text(
    store: Store,
    session: str,
    new: list[int],
    *,
    identity: ModelIdentity,
    namespace: str,
    bar: Progress | None,
    fresh: bool = False,
) -> Resumed:
    """``fresh``: a new transcript whatever the session holds (``--new``): its save does
    not replace the session, it is kept beside it (``save_turn``)."""
    try:
        if fresh:
            raise SessionNotFoundError(session, namespace)
        restored = store.restore(session, identity=identity, namespace=namespace, progress=bar)
    except SessionNotFoundError:
        hit = store.lookup(new, identity=identity, namespace=namespace)
        if hit is None:
            return Resumed(cache=None, tokens=new, covered=0, source="none", version=0)
        covered = len(hit.tokens)
        return Resumed(cache=hit.cache, tokens=new, covered=covered, source="prefix", version=0)
    if CHAT_KEY in restored.entry.metadata:  # raw text would end the chat's messages
        raise InvalidArgumentError(f"session {session!r} is a chat; continue it with --chat")
    tokens, unverified = restored.tokens + new, _unverified(restored)
    return Resumed(
        cache=restored.cache,
        tokens=tokens,
        covered=len(restored.tokens),
        source="session",
        version=restored.entry.id,
        unverified=unverified,
    )


def _unverified(restored: Any) -> bool:
    return bool(restored.entry.metadata.get(UNVERIFIED_KEY) == "true")


def save_turn(
    store: Store,
    cache: list[Any],
    tokens: list[int],
    *,
    identity: ModelIdentity,
    session: str,
    namespace: str,
    version: int,
    metadata: dict[str, str] | None = None,
    progress: Progress | None = None,
    unverified: bool = False,
) -> str:
    """Save a turn if the session is still the version it was read at; else keep it
    under the first free ``session~N`` (returned; ``rows.fork_name``, which every
    command takes) instead of dropping it: SessionConflictError past ``MAX_FORKS``.
    ``unverified``: the turn continues an unverified session (``Resumed``), under
    whatever name it is kept.  A fork keeps the session's pin and retention hints
    (``_kept_as``): it is the same conversation, which the user pinned."""
    name, n, kept = session, 1, dict[str, Any]()
    while True:
        try:
            store.save(
                cache,
                tokens,
                identity=identity,
                session=name,
                namespace=namespace,
                metadata=metadata,
                progress=progress,
                if_version=version,
                unverified_tokens=unverified,
                **kept,
            )
            return name
        except SessionConflictError:
            n += 1 + (fork_name(session, n + 1) == session)  # never the name that lost
            if n > MAX_FORKS:
                raise
            name, version = fork_name(session, n), 0
            kept = kept or _kept_as(store, session, namespace)


def _kept_as(store: Store, session: str, namespace: str) -> dict[str, Any]:
    """``Store.save``'s pin and hints arguments for a fork of ``session``: the session's."""
    try:
        pinned, hints = store.retention(session, namespace=namespace)
    except SessionNotFoundError:  # deleted meanwhile: nothing to keep
        return {}
    ttl, priority = hints if hints is not None else (None, None)
    return {"pin": pinned or None, "ttl": ttl, "priority": priority}


def resume_chat(
    store: Store,
    session: str,
    tokenizer: Any,
    *,
    prompt: str,
    system: str | None,
    identity: ModelIdentity,
    namespace: str,
    bar: Progress | None,
    template_kwargs: dict[str, Any] | None = None,
    fresh: bool = False,
) -> tuple[Resumed, list[dict[str, str]]]:
    """The turn's start and the chat's messages with the new user message appended
    (``fresh``: a new chat, as ``resume_text``)."""
    restored = None
    try:
        if not fresh:
            restored = store.restore(session, identity=identity, namespace=namespace, progress=bar)
    except SessionNotFoundError:
        restored = None
    messages: list[dict[str, str]] = []
    if restored is not None:
        if CHAT_KEY not in restored.entry.metadata:
            raise InvalidArgumentError(
                f"session {session!r} is a text session, not a chat; continue it without --chat"
            )
        messages = json.loads(restored.entry.metadata[CHAT_KEY])
        if system is not None:
            raise InvalidArgumentError("--system starts a chat; this chat has begun already")
    elif system is not None:
        messages = [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    size = len(json.dumps(messages).encode())
    if size > MAX_USER_METADATA - ANSWER_ROOM:  # refused before the turn, not after it
        raise InvalidMetadataError(
            f"the chat's messages take {size} bytes; a session keeps at most "
            f"{MAX_USER_METADATA >> 20} MiB of metadata: start a new chat"
        )
    full = list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **(template_kwargs or {})
        )
    )
    version = 0 if restored is None else restored.entry.id
    if restored is not None and full[: len(restored.tokens)] == restored.tokens:
        resumed = Resumed(
            cache=restored.cache,
            tokens=full,
            covered=len(restored.tokens),
            source="session",
            version=version,
            unverified=_unverified(restored),
        )
        return resumed, messages
    hit = store.lookup(full, identity=identity, namespace=namespace)
    if hit is None:
        return Resumed(cache=None, tokens=full, covered=0, source="none", version=version), messages
    covered = len(hit.tokens)
    resumed = Resumed(
        cache=hit.cache, tokens=full, covered=covered, source="prefix", version=version
    )
    return resumed, messages


def chat_metadata(messages: list[dict[str, str]], answer: str) -> dict[str, str]:
    return {CHAT_KEY: json.dumps([*messages, {"role": "assistant", "content": answer}])}
