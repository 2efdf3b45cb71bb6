"""Two `persist serve` processes (two "machines", two stores) sharing one Redis: a
conversation started on one continues on the other from the tier, with the text a
plain mlx_lm.server gives."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from tests.serve.servers import TURN1, TURN2, cached, text


def serve(model: Path, store: Path, shared: str, log: Path) -> Server:
    args = ["persist", "serve", "--model", str(model), "--store", str(store)]
    return Server([*args, "--shared", shared], log)


@pytest.mark.long
def test_a_conversation_moves_between_machines(
    model_dir: Any, redis_server: Any, tmp_path: Path
) -> None:
    model = model_dir("llama")
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    try:
        want = plain.chat(TURN2)
    finally:
        plain.stop()
    a = serve(model, tmp_path / "a", redis_server.url, tmp_path / "a.log")
    b = serve(model, tmp_path / "b", redis_server.url, tmp_path / "b.log")
    try:
        one = a.chat(TURN1)
        r = redis_server.client()
        deadline = time.monotonic() + 60  # the write-behind pushes after the answer
        while not r.keys("persist:*:rec:*") and time.monotonic() < deadline:
            time.sleep(0.1)
        got = b.chat(TURN2)
    finally:
        a.stop()
        b.stop()
    assert cached(one) == 0 and cached(got) >= 256  # at least one block came from the tier
    assert text(got) == text(want)
