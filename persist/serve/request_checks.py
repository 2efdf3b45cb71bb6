"""What ``persist serve`` accepts in a request body, checked before generation sees it.

mlx-lm's server hands the body's fields to its generation thread nearly as
they come: ``{"prompt": ["a"]}``, ``{"prompt": ""}`` or ``{"stop": [1]}``
raise inside the batch loop and stop generation for every later request,
and ``{"logit_bias": {"999999": 1}}`` indexes past the vocabulary and
crashes the process.  Every field mlx-lm reads is checked here, in the
request's own handler thread, and a bad one is an ``InvalidArgumentError``
naming the field (the handler answers 400).  Pure: no mlx, no HTTP.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["BadRequest", "check_request", "normalize", "parse_json", "public_mark"]

MAX_STOP = 64  # stop sequences per request (OpenAI allows 4; mlx-lm builds an automaton)
MAX_SEED = (1 << 64) - 1  # mx.random.seed takes an unsigned 64-bit seed
# name: (minimum, maximum); None is unbounded.  The ranges are mlx-lm's own checks.
NUMBERS: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0, None),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "repetition_penalty": (0, None),
    "presence_penalty": (None, None),
    "frequency_penalty": (None, None),
    "xtc_probability": (0, 1),
    "xtc_threshold": (0, 0.5),  # mlx-lm's XTC sampler refuses more, inside the batch step
}
FLOATS = ("xtc_probability", "xtc_threshold")  # mlx-lm refuses an integer (1) for these
MAX_DEPTH = 64  # nesting of arrays and objects: nothing mlx-lm reads is deeper than a few
# apply_chat_template's own arguments: set through chat_template_kwargs they collide with
# mlx-lm's (a TypeError) or change what it returns (tokenize: false gives a string)
TEMPLATE_RESERVED = frozenset(
    {"conversation", "tools", "tokenize", "add_generation_prompt", "return_dict",
     "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
     "max_length", "tokenizer_kwargs"}
)  # fmt: skip
MAX_CONTEXT = 1 << 20  # tokens a penalty looks back over: past any model's context
MAX_DRAFT = 64  # draft tokens a speculative step proposes (mlx-lm's default: 3)
INTEGERS: dict[str, tuple[int, int | None]] = {
    "max_tokens": (1, None),
    "max_completion_tokens": (1, None),
    "top_k": (0, None),
    # bounded: mlx-lm slices by them with 32-bit indices (2**32 raised inside generation,
    # failing the whole batch, and five such requests stopped the server)
    "num_draft_tokens": (0, MAX_DRAFT),
    "repetition_context_size": (0, MAX_CONTEXT),
    "presence_context_size": (0, MAX_CONTEXT),
    "frequency_context_size": (0, MAX_CONTEXT),
    "seed": (0, MAX_SEED),
}
BOOLEANS = ("stream", "logprobs")
STRINGS = ("model", "draft_model", "adapters")  # adapters may also be null


class BadRequest(InvalidArgumentError):
    """A request body persist serve refuses: ``param`` names the field (None: the body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON error body (OpenAI's shape, which clients already parse)."""
        return {
            "error": {"message": str(self), "type": "invalid_request_error", "param": self.param}
        }


def _constant(name: str) -> Any:
    raise BadRequest(f"the body is not JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; NaN and Infinity are refused (JSON has neither)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_constant)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8: {e}") from None
    except ValueError as e:  # JSONDecodeError, or an integer past Python's 4300 digits
        raise BadRequest(f"the body is not JSON this server takes: {e}") from None
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    """Nesting at most MAX_DEPTH deep, and every string encodable as UTF-8 (JSON lets a
    lone surrogate like \\ud800 through; the tokenizer raises on it later)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(f"the body holds a string that is not Unicode text: {e}") from None
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels")
        items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in items)


def normalize(body: dict[str, Any]) -> bool:
    """Fill in what mlx-lm reads without a default; True if ``body`` changed."""
    options = body.get("stream_options")
    if isinstance(options, dict) and "include_usage" not in options:
        options["include_usage"] = False  # mlx-lm reads ["include_usage"] mid-stream
        return True
    return False


def check_request(
    path: str, body: dict[str, Any], images: bool = False, marks: bool = False
) -> None:
    """Raise BadRequest for the first field of ``body`` mlx-lm could not serve
    (``images``: the model takes image parts in messages; ``marks``: the operator
    lets a request mark its system prompt public, ``--allow-public-marks``)."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string (one prompt per request)", "prompt")
    else:
        _check_messages(body.get("messages"), images)
        _optional(body, "tools", list)
        _optional(body, "role_mapping", dict)
    _optional(body, "chat_template_kwargs", dict)
    reserved = sorted(TEMPLATE_RESERVED.intersection(body.get("chat_template_kwargs") or ()))
    if reserved:
        raise BadRequest(
            f"chat_template_kwargs cannot set {', '.join(reserved)} (the server sets them)",
            "chat_template_kwargs",
        )
    _optional(body, "stream_options", dict)
    if isinstance(body.get("stream_options"), dict):
        _optional(body["stream_options"], "include_usage", bool, "stream_options.include_usage")
    for name in BOOLEANS:
        _optional(body, name, bool)
    for name in STRINGS:
        _optional(body, name, str)
    for name, (lo, hi) in NUMBERS.items():
        _number(body, name, lo, hi)
    for name in FLOATS:
        if isinstance(body.get(name), int):
            raise BadRequest(f"{name} must be written as a decimal number (1.0, not 1)", name)
    for name, (ilo, ihi) in INTEGERS.items():
        _integer(body, name, ilo, ihi)
    _check_top_logprobs(body.get("top_logprobs"))
    _check_stop(body.get("stop"))
    _check_logit_bias(body.get("logit_bias"))
    _check_mark(path, body, marks)


# the request extension's fields: the public mark (here) and retention hints (serve.hints)
PERSIST_FIELDS = frozenset({"public_system", "ttl", "priority", "pin"})


def public_mark(body: dict[str, Any]) -> bool:
    """Whether a checked body marks its system prompt public (``persist.public_system``)."""
    field = body.get("persist")
    return isinstance(field, dict) and field.get("public_system") is True


def _check_mark(path: str, body: dict[str, Any], allowed: bool) -> None:
    """``"persist": {"public_system": true}``: the request's system block goes to the
    public namespace (docs/tenants.md); refused where it cannot be honoured, never
    ignored: a client that asked to share gets told it did not."""
    field = body.get("persist")
    if field is None:
        return
    if not isinstance(field, dict) or not set(field) <= PERSIST_FIELDS:
        raise BadRequest(
            "persist must be a JSON object of public_system, ttl, priority and pin", "persist"
        )
    mark = field.get("public_system")
    if mark is not None and not isinstance(mark, bool):
        raise BadRequest("persist.public_system must be a boolean", "persist")
    if not mark:
        return
    if not allowed:
        raise BadRequest(
            "persist.public_system: this server takes no public marks (its operator "
            "starts it with --allow-public-marks to let requests share a system prompt)",
            "persist",
        )
    messages = body.get("messages")
    if path == "/v1/completions" or not (messages and messages[0].get("role") == "system"):
        raise BadRequest(
            "persist.public_system marks a chat request's leading system messages: "
            "this request has none",
            "persist",
        )
    last = messages[-1]
    if last.get("role") != "user" or not _has_text(last.get("content")):
        raise BadRequest(  # mlx-lm splits no system segment off it (attack r15: ignored)
            "persist.public_system: mlx-lm splits a chat's system block off only when its "
            "last message is the user's, with text: this request's is not",
            "persist",
        )
    if body.get("chat_template_kwargs"):  # a template may render them in the system block
        raise BadRequest(
            "persist.public_system: a request with chat_template_kwargs is never public "
            "(a template may render them in the system block)",
            "persist",
        )


def _has_text(content: Any) -> bool:
    """A message's content holds text (an empty one renders as the template's empty
    user turn: mlx-lm then finds no end to the system block)."""
    if isinstance(content, str):
        return content != ""
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "text" and bool(p.get("text")) for p in content
    )


def _optional(body: dict[str, Any], name: str, kind: type, label: str | None = None) -> None:
    value = body.get(name)
    if value is not None and not (isinstance(value, kind) and _not_bool_for(kind, value)):
        raise BadRequest(f"{label or name} must be a {_type_name(kind)} or null", label or name)


def _not_bool_for(kind: type, value: Any) -> bool:
    # bool is an int in Python, never in JSON: true is not a token count
    return kind is bool or not isinstance(value, bool)


def _type_name(kind: type) -> str:
    names = {dict: "JSON object", list: "list", str: "string", bool: "boolean"}
    return names.get(kind, kind.__name__)


def _number(body: dict[str, Any], name: str, lo: float | None, hi: float | None) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} must be a finite number", name)
    _range(name, v, lo, hi)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int | None) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer", name)
    _range(name, v, lo, hi)


def _range(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and v < lo:
        raise BadRequest(f"{name} must be at least {lo}, not {v}", name)
    if hi is not None and v > hi:
        raise BadRequest(f"{name} must be at most {hi}, not {v}", name)


def _check_top_logprobs(v: Any) -> None:
    # mlx-lm: 0..11 (its default -1 means none)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not -1 <= v <= 11):
        raise BadRequest("top_logprobs must be an integer from 0 to 11", "top_logprobs")


def _check_stop(stop: Any) -> None:
    if stop is None or (isinstance(stop, str) and stop):
        return
    if (
        isinstance(stop, list)
        and len(stop) <= MAX_STOP
        and all(isinstance(s, str) and s for s in stop)
    ):
        return
    raise BadRequest(
        f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
        "stop",
    )


def _check_logit_bias(bias: Any) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > 1 << 16:
        raise BadRequest("logit_bias must be a JSON object of token ids to numbers", "logit_bias")
    for k, v in bias.items():
        # the upper bound is the model's vocabulary: checked where the model is known
        if not (isinstance(k, str) and k.isdigit()):
            raise BadRequest(f"logit_bias key {k!r} is not a token id", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise BadRequest(f"logit_bias[{k}] must be a finite number", "logit_bias")


def _check_messages(messages: Any, images: bool) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be a JSON object", "messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRequest(f"{where}.role must be a non-empty string", "messages")
        _check_content(m.get("content"), where, images)
        _check_tool_calls(m.get("tool_calls"), where)


def _check_tool_calls(calls: Any, where: str) -> None:
    if calls is None:
        return
    if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise BadRequest(f"{where}.tool_calls must be a list of objects", "messages")
    for j, call in enumerate(calls):
        func = call.get("function")
        if func is None:
            continue
        if not isinstance(func, dict):
            raise BadRequest(f"{where}.tool_calls[{j}].function must be an object", "messages")
        args = func.get("arguments")
        if isinstance(args, str) and args:
            try:  # mlx-lm decodes it for the chat template
                args = json.loads(args)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise BadRequest(
                    f"{where}.tool_calls[{j}].function.arguments must hold a JSON object",
                    "messages",
                )


def _check_content(content: Any, where: str, images: bool) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string, a list of parts or null", "messages")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRequest(f"{where}.content[{j}] must be an object with a type", "messages")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content[{j}].text must be a string", "messages")
        if part["type"] != "text" and not images:
            # refused here, before mlx-lm would fetch an http(s) image URL for nothing
            raise BadRequest(
                f"{where}.content[{j}] is a {part['type']!r} part; this model takes text only",
                "messages",
            )
