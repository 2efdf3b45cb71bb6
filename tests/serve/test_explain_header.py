"""``X-Persist-Explain`` as a request sends it (attack r14b: two headers that disagree
were taken silently, the first winning)."""

from __future__ import annotations

import http.client

import pytest

from persist.serve.explaining import explain_asked
from persist.serve.request_checks import BadRequest


def headers(*values: str) -> http.client.HTTPMessage:
    msg = http.client.HTTPMessage()
    for v in values:
        msg["X-Persist-Explain"] = v
    return msg


def test_yes_and_no_in_their_documented_spellings() -> None:
    for v in ("1", "true", "yes", " TRUE "):
        assert explain_asked(headers(v))
    for v in ("0", "false", "no"):
        assert not explain_asked(headers(v))
    assert not explain_asked(headers())
    assert explain_asked(headers("1", "yes"))  # the same answer twice


def test_headers_that_disagree_or_say_neither_are_refused() -> None:
    with pytest.raises(BadRequest, match="disagree"):
        explain_asked(headers("1", "0"))
    with pytest.raises(BadRequest, match="1 or 0"):
        explain_asked(headers("maybe"))
