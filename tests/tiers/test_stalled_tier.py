"""A session name means one history fleet-wide, also while the tier stalls.

Found from outside (round 5's attack): with Redis stalled (SIGSTOP, as a failover or a long fork
does), ``persist generate --session chat`` on a machine that did not hold
``chat`` warned once and started a new conversation under that name; its
``persist sync`` then reported "pushed 1" and replaced the fleet's pointer,
so a new machine resumed the one-turn fork.  Real redis-server, real
``persist`` processes, one store folder per machine.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import persist_cli


@pytest.mark.long
def test_a_stalled_tier_never_forks_a_session(
    model_dir: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, env = str(model_dir("llama")), {"PERSIST_SHARED": redis_server.url}

    def generate(machine: str, prompt: str, *extra: str, session: str = "chat") -> Any:
        return persist_cli(
            tmp_path / machine, "generate", "--model", model, "--session", session,
            "--prompt", prompt, "--max-tokens", "3", "--json", *extra,
            "--store", str(tmp_path / machine / "store"), check=False, env=env,
        )  # fmt: skip

    first = generate("a", "a conversation that began on machine a")
    assert first.returncode == 0, first.stderr
    fleet = json.loads(generate("a", " and went on there").stdout)["session_tokens"]

    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        stalled = generate("b", "hello")
        assert stalled.returncode == 1, stalled.stderr
        said = json.loads(stalled.stdout)["error"]  # --json: the error as JSON on stdout
        assert "session 'chat' is not in this store" in said, said
        assert f"shared tier (redis://127.0.0.1:{redis_server.port}/0)" in said, said
        assert "--new" in said, said
        with persist.Store(tmp_path / "b" / "store") as b:
            assert not b.has_session("chat")  # nothing started under the fleet's name
        fork = generate("b", "a new conversation on purpose", "--new")
        assert fork.returncode == 0, fork.stderr  # local save stands; the push waits
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)

    sync = persist_cli(tmp_path / "b", "sync", "--store", str(tmp_path / "b" / "store"),
                       check=False, env=env)  # fmt: skip
    assert sync.returncode == 1, (sync.stdout, sync.stderr)
    assert "conflict: session 'chat' here does not continue" in sync.stdout, sync.stdout
    assert "pushed as 'chat~2'" in sync.stdout, sync.stdout

    # a new machine resumes the fleet's history under the name, the fork beside it
    resumed = json.loads(generate("c", " and on machine c").stdout)
    assert resumed["source"] == "session" and resumed["reused_tokens"] == fleet, resumed
    forked = json.loads(generate("d", " and the fork", session="chat~2").stdout)
    assert forked["source"] == "session", forked
    assert forked["reused_tokens"] == json.loads(fork.stdout)["session_tokens"], forked

    # machine a holds an older version of chat than c left on the tier: its next turn
    # forks from the fleet's, and is pushed beside it, never over it
    again = generate("a", " and back on a")
    assert again.returncode == 0, again.stderr
    late = persist_cli(tmp_path / "a", "sync", "--store", str(tmp_path / "a" / "store"),
                       check=False, env=env)  # fmt: skip
    assert late.returncode == 1 and "pushed as 'chat~3'" in late.stdout, late.stdout
    latest = json.loads(generate("e", " and on machine e").stdout)
    assert latest["reused_tokens"] == resumed["session_tokens"], latest  # c's, the fleet's
