"""``persist serve --warm N``: a restarted server reads the store's most valuable
entries into the host tier before it listens, and the first returning
conversation is answered from RAM, as a fresh server given it alone answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from persist.serve.warm_start import WARMUP_TOKENS, alone, batched, warmup_tokens
from tests.serve.servers import TURN1, TURN2, hits, metrics, persist_serve, text


@pytest.mark.long
def test_a_warm_restart_answers_the_first_returning_chat_from_ram(
    model_dir: Any, tmp_path: Path
) -> None:
    model, store = model_dir("llama"), tmp_path / "store"
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    try:
        want = plain.chat(TURN2)
    finally:
        plain.stop()
    first = persist_serve(model, store, tmp_path / "a.log")
    try:
        first.chat(TURN1)  # stored by the write-behind, flushed at the stop
    finally:
        first.stop()
    log = tmp_path / "b.log"
    srv = persist_serve(model, store, log, "--warm", "5", "--host-cache", "256M")
    try:
        before = metrics(srv)
        got = srv.chat(TURN2)
        after = metrics(srv)
    finally:
        srv.stop()
    said = log.read_text()
    assert "warm start:" in said and "0 entries" not in said
    assert hits(after, "host") - hits(before, "host") == 1  # from RAM ...
    assert hits(after, "local") == hits(before, "local")  # ... not from the store
    assert text(got) == text(want)


@pytest.mark.long
def test_warm_without_a_host_cache_says_so_and_serves(model_dir: Any, tmp_path: Path) -> None:
    model, log = model_dir("llama"), tmp_path / "s.log"
    srv = persist_serve(model, tmp_path / "store", log, "--warm", "5", "--host-cache", "0")
    try:
        assert text(srv.chat(TURN1))
    finally:
        srv.stop()
    assert "--warm needs the host tier" in log.read_text()


def test_the_model_runs_once_before_the_server_listens(model_dir: Any, tmp_path: Path) -> None:
    # The kernels MLX compiles at first use are built at start, not in the first
    # request: the log says so before any request was sent.
    log = tmp_path / "s.log"
    srv = persist_serve(model_dir("llama"), tmp_path / "store", log)
    try:
        said = log.read_text()
        assert "model loaded and its kernels built in" in said
        assert text(srv.chat(TURN1))
    finally:
        srv.stop()


def test_the_warm_up_prompt_is_long_prompts_chunks_on_a_gpu() -> None:
    # a GPU builds kernels per shape: a full chunk, one after a chunk, a partial one
    assert warmup_tokens(2048, gpu=True, context=None) == 2048 * 2 + 1024
    assert warmup_tokens(2048, gpu=False, context=None) == WARMUP_TOKENS
    assert warmup_tokens(512, gpu=True, context=131072) == 1280
    assert warmup_tokens(2048, gpu=True, context=1024) == 1021  # never past the context
    assert warmup_tokens(2048, gpu=True, context=3) == 2


def test_the_warm_up_runs_mlx_lms_batched_prefill_chunk_by_chunk(tiny: Any) -> None:
    # the path a batchable request takes, in chunks of --prefill-step-size
    model, tok, _ = tiny("llama")
    ids = tok.encode("warm up " * 160)[:160]
    assert batched(model, ids, step=64) == 159  # the last one is the first decode step's


def test_a_model_mlx_lm_serves_alone_is_warmed_alone(tiny: Any) -> None:
    # a draft model or --kv-bits: mlx-lm's server runs such requests one at a time
    model, tok, _ = tiny("llama")
    alone(model, tok.encode("warm up " * 100)[:100], step=32)
