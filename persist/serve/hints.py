"""Retention hints in a ``persist serve`` request: how long a prefix matters to its client.

Two ways to say it, both optional:

- Anthropic's ``cache_control`` on a chat message (or on a text part of its
  content): ``{"type": "ephemeral"}`` (a 5-minute ttl) or with ``"ttl": "5m"`` or
  ``"1h"``.  It marks the prefix up to and including that message, as
  Anthropic's cache breakpoints do; at most ``MAX_MARKS`` marks a request.
- persist's extension, a body field ``"persist": {"ttl": ..., "priority": N,
  "pin": true}``, for the whole prompt: ``ttl`` as ``persist pin --ttl`` takes it
  (``30s``, ``5m``, ``1h``, ``2d`` or seconds, at most 30 days), ``priority`` from
  -1000 to 1000, and ``pin`` the strongest hint there is (30 days, priority 1000
  unless one is given): still a hint, so the budget still evicts it last.

A save of the request's cache (``SaveHints.for_length``) takes the longest ttl
of the marks it covers, and the extension's.  Without any hint: none (least
recently used first).  Bad values are a ``BadRequest`` (400, OpenAI's error
shape).  The marks are taken out of the body: the chat template never sees
them, so a prompt is the same tokens with and without them.  Pure: no mlx.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.lifecycle import MAX_PRIORITY, MAX_TTL, check_hints, parse_ttl, stronger_hints
from ..errors import InvalidArgumentError
from .request_checks import PERSIST_FIELDS, BadRequest

__all__ = [
    "RequestHints",
    "SaveHints",
    "HintedKeys",
    "take_hints",
    "cuts",
    "split_at_marks",
    "MAX_MARKS",
]

MAX_MARKS = 4  # cache_control marks per request, as Anthropic allows
TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache_control ttl values
DEFAULT_TTL = "5m"  # Anthropic's, when a mark names none


@dataclass(frozen=True)
class RequestHints:
    """What a request asked for: ``marks`` (message index, ttl seconds) and the
    extension's whole-prompt ``ttl`` and ``priority``."""

    marks: tuple[tuple[int, float], ...] = ()
    ttl: float = 0.0
    priority: int = 0


@dataclass(frozen=True)
class SaveHints:
    """The hints of one request's saves: ``marks`` as (prefix tokens, ttl seconds)."""

    marks: tuple[tuple[int, float], ...]
    ttl: float
    priority: int

    def for_length(self, n: int) -> tuple[float, int] | None:
        """(ttl, priority) of a save of the prompt's first ``n`` tokens (None: none)."""
        ttl = max([self.ttl, *(t for cut, t in self.marks if cut <= n)])
        return None if ttl <= 0 and self.priority == 0 else (ttl, self.priority)


def take_hints(endpoint: str, body: dict[str, Any]) -> tuple[RequestHints | None, bool]:
    """(the request's hints or None, whether ``body`` changed): the marks and the
    extension are taken out of it.  BadRequest for a bad one."""
    marks, changed = [], False
    for i, m in enumerate(body.get("messages") or ()):
        if endpoint == "/v1/completions" or not isinstance(m, dict):
            break
        found = []
        if "cache_control" in m:
            found.append(_mark(m.pop("cache_control"), f"messages[{i}].cache_control"))
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and "cache_control" in part:
                found.append(_mark(part.pop("cache_control"), f"messages[{i}].content[{j}]"))
        changed = changed or bool(found)
        if any(t is not None for t in found):
            marks.append((i, max(t for t in found if t is not None)))
    if len(marks) > MAX_MARKS:
        raise BadRequest(f"at most {MAX_MARKS} messages may carry cache_control", "messages")
    changed = changed or "persist" in body
    ext = body.pop("persist", None)
    ttl, priority = _extension(ext) if ext is not None else (0.0, 0)
    if not marks and ttl <= 0 and priority == 0:
        return None, changed
    return RequestHints(tuple(marks), ttl, priority), changed


def _mark(value: Any, where: str) -> float | None:
    """The ttl (seconds) of one cache_control value (None: null, no mark)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise BadRequest(f'{where} must be {{"type": "ephemeral"}}, with a ttl if any', "messages")
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise BadRequest(f"{where} takes type and ttl only, not {', '.join(unknown)}", "messages")
    ttl = value.get("ttl", DEFAULT_TTL)
    if ttl not in TTLS:
        raise BadRequest(f'{where}.ttl must be "5m" or "1h", not {ttl!r}', "messages")
    return TTLS[ttl]


def _extension(ext: Any) -> tuple[float, int]:
    """(ttl seconds, priority) of the ``persist`` body field."""
    if not isinstance(ext, dict):
        raise BadRequest('persist must be a JSON object: {"ttl", "priority", "pin"}', "persist")
    unknown = sorted(set(ext) - PERSIST_FIELDS)  # public_system: request_checks's
    if unknown:
        names = ", ".join(unknown)
        raise BadRequest(f"persist takes ttl, priority and pin, not {names}", "persist")
    pin = ext.get("pin", False)
    if not isinstance(pin, bool):
        raise BadRequest("persist.pin must be true or false", "persist")
    raw_ttl = ext.get("ttl")
    try:
        if isinstance(raw_ttl, bool) or not isinstance(raw_ttl, (str, int, float, type(None))):
            raise InvalidArgumentError(f"a ttl is seconds or text like 1h, not {raw_ttl!r}")
        ttl = 0.0 if raw_ttl is None else parse_ttl(str(raw_ttl))
        priority = ext.get("priority", MAX_PRIORITY if pin else 0)
        if isinstance(priority, bool):  # JSON's true is no number
            raise InvalidArgumentError(f"priority is a whole number, not {priority!r}")
        got = check_hints(MAX_TTL if pin else ttl, priority)
    except InvalidArgumentError as e:
        raise BadRequest(f"persist: {e}", "persist") from None
    return got if got is not None else (0.0, 0)


def cuts(hints: RequestHints, render: Any, prompt: Sequence[int]) -> tuple[tuple[int, float], ...]:
    """Each mark as (prompt tokens up to and including its message, ttl): ``render(k)``
    is the prompt's first k messages through the chat template without a generation
    prompt; the cut is where that meets the prompt.  A template that refuses a part
    of the conversation marks the whole prompt."""
    out = []
    for i, ttl in hints.marks:
        try:
            part = list(render(i + 1))
        except Exception:  # the template's own rules (e.g. a conversation must end a turn)
            part = list(prompt)
        n = next((k for k, (a, b) in enumerate(zip(part, prompt, strict=False)) if a != b), None)
        out.append((min(len(part), len(prompt)) if n is None else n, ttl))
    return tuple(out)


def save_hints(
    tokenizer: Any, request: Any, template_kwargs: dict[str, Any], prompt: Sequence[int]
) -> SaveHints:
    """A request's hints (``request.persist_hints``), its marks as prompt lengths: each
    marked message's end through the chat template as mlx-lm renders the prompt
    (``cuts``); a completion, or a tokenizer without a template, marks the whole prompt."""
    asked = request.persist_hints
    if request.request_type != "chat" or not getattr(tokenizer, "has_chat_template", False):
        whole = tuple((len(prompt), ttl) for _, ttl in asked.marks)
        return SaveHints(whole, asked.ttl, asked.priority)

    def render(k: int) -> list[int]:
        head = request.messages[:k]
        return list(tokenizer.apply_chat_template(
            head, add_generation_prompt=False, tools=request.tools, tokenize=True,
            **template_kwargs,
        ))  # fmt: skip

    return SaveHints(cuts(asked, render, prompt), asked.ttl, asked.priority)


def split_at_marks(
    segments: list[list[int]], kinds: list[str], marks: Sequence[int]
) -> tuple[list[list[int]], list[str]]:
    """mlx-lm's prompt segments cut again at each mark (a prompt length) strictly
    inside one: mlx-lm stores a cache at every segment end, so a model whose cache
    cannot be cut back (recurrent state) gets a snapshot where the client said the
    prefix matters, not only where the system prompt ends.  The pieces keep their
    segment's kind; their concatenation is the prompt."""
    out: list[list[int]] = []
    out_kinds: list[str] = []
    start = 0
    for seg, kind in zip(segments, kinds, strict=True):
        inside = sorted({m - start for m in marks if start < m < start + len(seg)})
        for a, b in zip([0, *inside], [*inside, len(seg)], strict=True):
            out.append(seg[a:b])
            out_kinds.append(kind)
        start += len(seg)
    return out, out_kinds


Hints = tuple[float, int]


class HintedKeys:
    """The hints of the caches mlx-lm's memory holds, by (model key, tokens): one it
    evicts goes to the host tier with its hints.  A cache that drops the prefixes it
    covers (mlx-lm does, for a trimmable one) serves them now, so it takes their
    hints (``policy.stronger_hints``).  Bounded: the oldest are forgotten."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._hints: OrderedDict[tuple[Any, tuple[int, ...]], Hints] = OrderedDict()

    def add(self, model: Any, tokens: Sequence[int], hints: Hints | None, covers: bool) -> None:
        key = (model, tuple(tokens))
        if covers:
            for (m, t), h in list(self._hints.items()):
                if m == model and len(t) <= len(key[1]) and key[1][: len(t)] == t:
                    hints = stronger_hints(hints, h)
                    del self._hints[(m, t)]
        if hints is None:
            return
        self._hints[key] = hints
        self._hints.move_to_end(key)
        while len(self._hints) > self.limit:
            self._hints.popitem(last=False)

    def pop(self, model: Any, tokens: Sequence[int]) -> Hints | None:
        return self._hints.pop((model, tuple(tokens)), None)

    def get(self, model: Any, tokens: Sequence[int]) -> Hints | None:
        return self._hints.get((model, tuple(tokens)))
