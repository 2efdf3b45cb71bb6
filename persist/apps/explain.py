"""``persist explain``: a prompt tokenized as ``persist generate`` would send it to a
lookup, and the store's explanation of what it would reuse (``Store.explain``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from ..identity import ModelIdentity

if TYPE_CHECKING:
    from ..engine.explain import Explanation
    from ..engine.store import Store

__all__ = ["prompt_tokens", "explain_text"]


def prompt_tokens(tokenizer: Any, text: str, *, chat: bool, system: str | None) -> list[int]:
    """The tokens ``persist generate`` looks up for ``text`` in a new session: the raw
    text, or with ``chat`` one user message (after ``system``) in the chat template."""
    if system is not None and not chat:
        raise InvalidArgumentError("--system needs --chat")
    if not chat:
        return list(tokenizer.encode(text, add_special_tokens=False))
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": text})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out)


def explain_text(
    store: Store,
    tokenizer: Any,
    identity: ModelIdentity,
    text: str,
    *,
    chat: bool = False,
    system: str | None = None,
    namespace: str = "default",
    other_namespaces: bool = True,
    limit: int = 5,
) -> Explanation:
    toks = prompt_tokens(tokenizer, text, chat=chat, system=system)
    if not toks:
        raise InvalidArgumentError("the prompt is empty after tokenization")
    return store.explain(
        toks, identity=identity, namespace=namespace, tokenizer=tokenizer, limit=limit,
        other_namespaces=other_namespaces,
    )  # fmt: skip
