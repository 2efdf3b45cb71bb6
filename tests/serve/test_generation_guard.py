"""The generation thread of ``persist serve`` survives a failing request (in process).

A real mlx-lm ``ModelProvider`` on the tiny model and a real batch loop;
the failure is injected into one ``BatchGenerator.next`` call (a fault no
request check can catch), which in mlx-lm ends the thread for good.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx_lm.server as server
import pytest
from mlx_lm.models.cache import LRUPromptCache

import persist
from persist.serve.generation import GenerationFailed, GuardedGenerator, RestartBudget
from persist.serve.metrics import ServeMetrics
from persist.serve.request_checks import BadRequest
from tests.serve.generators import cli_args, request


def answer(gen: GuardedGenerator, prompt: str, **kw: Any) -> str:
    _ctx, responses = gen.generate(*request(prompt, **kw))
    return "".join(r.text for r in responses)


@pytest.fixture
def failing_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``fail[0]`` more calls of BatchGenerator.next raise (the fault an engine bug makes)."""
    fail = [0]
    real = server.BatchGenerator.next

    def next_(self: Any) -> Any:
        if fail[0] > 0:
            fail[0] -= 1
            raise RuntimeError("injected: a batch step failed")
        return real(self)

    monkeypatch.setattr(server.BatchGenerator, "next", next_)
    yield fail


def test_a_failing_step_fails_its_requests_only(model_dir: Any, failing_steps: list[int]) -> None:
    provider = server.ModelProvider(cli_args(str(model_dir("llama"))))
    gen = GuardedGenerator(provider, LRUPromptCache())
    try:
        want = answer(gen, "hello there, how are")
        failing_steps[0] = 1
        with pytest.raises(GenerationFailed, match="injected"):
            answer(gen, "hello there, how are")
        assert gen.generation_available() and gen.failures == 1
        assert answer(gen, "hello there, how are") == want  # the loop started again
        # what only the model can check fails its own request, and nothing else
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            answer(gen, "hello", logit_bias={10**6: 1.0})
        assert answer(gen, "hello there, how are") == want
    finally:
        gen.stop_and_join()


def test_failures_past_the_budget_stop_generation_for_good(
    model_dir: Any, failing_steps: list[int], tmp_path: Path
) -> None:
    provider = server.ModelProvider(cli_args(str(model_dir("llama"))))
    gen = GuardedGenerator(provider, LRUPromptCache(), RestartBudget(failures=1, window=3600))
    try:
        failing_steps[0] = 10**6  # every step fails: restarting cannot help
        for _ in range(2):
            with pytest.raises(GenerationFailed):
                answer(gen, "hello there")
        gen.died.wait(60)
        assert not gen.generation_available()
        assert gen.death is not None and "more than 1 failures" in gen.death
        with pytest.raises(GenerationFailed, match="generation has stopped"):
            answer(gen, "hello there")
        with persist.Store(tmp_path / "store") as store:  # what /health (503) then says
            m = ServeMetrics(store)
            m.generator = gen
            health = m.health()
        assert health["status"] == "unavailable" and health["generation"]["alive"] is False
        assert health["generation"]["stopped"] == gen.death
    finally:
        gen.stop_and_join()


def test_restart_budget_counts_failures_in_its_window() -> None:
    now = [0.0]
    budget = RestartBudget(failures=2, window=10.0, clock=lambda: now[0])
    assert budget.spend() and budget.spend()
    assert not budget.spend()  # a third within 10 s
    now[0] = 100.0
    assert budget.spend()  # the old ones have left the window


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_stop_and_join_returns_once_the_generation_thread_has_left_the_os(
    model_dir: Any,
) -> None:
    """mlx-lm's join returned as the thread's Python part ended; its C++ thread-locals
    (MLX's compile cache, holding the sampler's compiled Python functions) were freed
    after that, taking the GIL: a process that stopped at once sometimes finalized
    first, and that thread's exit aborted it ("terminate called without an active
    exception", SIGABRT after `persist serve`'s stop line, round 5 under CPU load)."""
    provider = server.ModelProvider(cli_args(str(model_dir("llama"))))
    gen = GuardedGenerator(provider, LRUPromptCache())
    try:
        answer(gen, "hello there, how are")  # the model's compiled functions (swiglu)
    finally:
        gen.stop_and_join()
    tid = gen._generation_thread.native_id
    assert tid is not None and not Path(f"/proc/self/task/{tid}").exists()
