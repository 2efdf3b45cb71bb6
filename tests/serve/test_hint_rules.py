"""What a ``persist serve`` request may say about retention (``serve.hints``): Anthropic's
``cache_control`` marks and persist's extension, what each save of the request gets,
and the 400 every bad value is.  The cuts are taken with the tiny model's real
tokenizer and chat template."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from persist.serve.hints import HintedKeys, RequestHints, SaveHints, cuts, take_hints
from persist.serve.request_checks import BadRequest

CHAT = "/v1/chat/completions"
EPHEMERAL = {"type": "ephemeral"}


def agent(mark: dict[str, Any] | None = None, where: int = 0) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent with tools. " * 4},
        {"role": "user", "content": "Read this document: " + "lorem ipsum " * 10},
        {"role": "assistant", "content": "Read."},
        {"role": "user", "content": "Summarize it."},
    ]
    if mark is not None:
        messages[where]["cache_control"] = mark
    return messages


def test_marks_and_the_extension_are_read_and_taken_out() -> None:
    body = {"messages": agent({"type": "ephemeral", "ttl": "1h"}), "persist": {"priority": 3}}
    body["messages"][1]["content"] = [
        {"type": "text", "text": "a part", "cache_control": EPHEMERAL}
    ]
    hints, changed = take_hints(CHAT, body)
    assert changed and hints == RequestHints(((0, 3600.0), (1, 300.0)), 0.0, 3)
    assert "persist" not in body and "cache_control" not in body["messages"][0]
    assert body["messages"][1]["content"] == [{"type": "text", "text": "a part"}]


def test_no_hint_is_no_hints_and_no_change() -> None:
    body = {"messages": agent()}
    before = copy.deepcopy(body)
    assert take_hints(CHAT, body) == (None, False) and body == before


def test_pin_is_the_strongest_hint_and_a_ttl_is_written_as_clients_write_it() -> None:
    assert take_hints(CHAT, {"messages": agent(), "persist": {"pin": True}})[0] == (
        RequestHints((), 30 * 86400.0, 1000)
    )
    got = take_hints("/v1/completions", {"prompt": "x", "persist": {"ttl": "2d"}})[0]
    assert got == RequestHints((), 172800.0, 0)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": agent({"type": "persistent"})},
        {"messages": agent({"type": "ephemeral", "ttl": "2h"})},
        {"messages": agent({"type": "ephemeral", "scope": "global"})},
        {"messages": agent("yes")},  # type: ignore[arg-type]
        {"messages": [{**m, "cache_control": EPHEMERAL} for m in agent() + agent()]},  # 8
        {"messages": agent(), "persist": {"priority": "high"}},
        {"messages": agent(), "persist": {"priority": 1001}},
        {"messages": agent(), "persist": {"priority": True}},
        {"messages": agent(), "persist": {"ttl": "forever"}},
        {"messages": agent(), "persist": {"ttl": [1]}},
        {"messages": agent(), "persist": {"pin": "yes"}},
        {"messages": agent(), "persist": {"keep": 1}},
        {"messages": agent(), "persist": 5},
    ],
)
def test_a_bad_hint_is_a_400_naming_its_field(body: dict[str, Any]) -> None:
    # the field the bad hint is in: the persist extension's own, else the messages'
    field = "persist" if "persist" in body else "messages"  # take_hints takes it out
    with pytest.raises(BadRequest) as e:
        take_hints(CHAT, body)
    assert e.value.body()["error"]["param"] == field
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_a_mark_cuts_the_prompt_after_its_message(tiny: Any) -> None:
    _, tok, _ = tiny("llama")
    messages = agent()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def render(k: int) -> list[int]:
        return list(tok.apply_chat_template(messages[:k], add_generation_prompt=False))

    got = cuts(RequestHints(((0, 3600.0), (1, 300.0))), render, prompt)
    one, two = render(1), render(2)
    assert got == ((len(one), 3600.0), (len(two), 300.0))
    assert prompt[: len(one)] == one and prompt[: len(two)] == two
    save = SaveHints(got, 0.0, 2)
    assert save.for_length(len(one) - 1) == (0.0, 2)  # before any mark: the priority only
    assert save.for_length(len(one)) == (3600.0, 2)
    assert save.for_length(len(prompt)) == (3600.0, 2)  # the longest ttl it covers
    assert SaveHints(got, 0.0, 0).for_length(len(one) - 1) is None


def test_memory_keeps_the_hints_of_what_it_holds() -> None:
    keys = HintedKeys(limit=3)
    keys.add("m", [1, 2, 3], (3600.0, 0), covers=False)
    keys.add("m", [1, 2, 3, 4, 5], None, covers=True)  # drops [1, 2, 3], serves it now
    assert keys.pop("m", [1, 2, 3]) is None
    assert keys.pop("m", [1, 2, 3, 4, 5]) == (3600.0, 0)
    for i in range(5):
        keys.add("m", [i], (60.0, i), covers=False)
    assert keys.pop("m", [0]) is None and keys.pop("m", [4]) == (60.0, 4)  # bounded
