"""``persist serve --draft-model``: the memory tier's caches cover exactly their key.

mlx-lm's server keys a cache by the prompt and every generated token; after
speculative decoding the last token is often not yet in the model's cache
(``speculative_generate_step`` yields the verified token before feeding it).
Handed out under that key, or trimmed to a shared prefix from it, the cache
is one position short and turn 2 answers differently.  The oracle is a fresh
prefill of turn 2's own tokens (plain ``mlx_lm.server`` has the same flaw in
its own memory, so it is no oracle) and the same request on a fresh server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

import persist
from bench.servers import Server
from persist.serve.server import PersistentPromptCache
from tests.serve.servers import TURN1, TURN2, cached, text

DRAFT_TOKENS = 12


def draft_serve(model: Path, draft: Path, store: Path, log: Path) -> Server:
    return Server(
        [
            "persist", "serve", "--model", str(model), "--store", str(store),
            "--draft-model", str(draft), "--num-draft-tokens", "2",
        ],
        log,
    )  # fmt: skip


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float32 model and a draft that disagrees with it (same tokenizer): bfloat16
    logprobs are too coarse to see one missing position of a tiny model, whose
    greedy tokens repeat one token whatever the context."""
    from persist.apps.demo import make_model

    root = tmp_path_factory.mktemp("draft_models")
    main = make_model(root / "main", "llama", dtype="float32", seed=2)
    return main, make_model(root / "draft", "llama", dtype="float32", seed=3)


def answer(resp: dict[str, Any]) -> tuple[str, list[float]]:
    return text(resp), [c["logprob"] for c in resp["choices"][0]["logprobs"]["content"]]


def fresh_prefill_answer(
    model_dir: Path, draft_dir: Path, messages: list[dict[str, str]]
) -> list[float]:
    """Turn 2's logprobs from a fresh cache of its own tokens, decoded as the server
    decodes (the same draft, the same number of draft tokens)."""
    model, tok = load(str(model_dir))
    draft, _ = load(str(draft_dir))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    return [
        g.logprobs[g.token].item()
        for g in stream_generate(
            model, tok, prompt, max_tokens=DRAFT_TOKENS, draft_model=draft, num_draft_tokens=2
        )
    ]


@pytest.mark.long
def test_turn_two_after_speculative_turn_one(f32_pair: tuple[Path, Path], tmp_path: Path) -> None:
    model, draft = f32_pair
    alone = draft_serve(model, draft, tmp_path / "fresh", tmp_path / "fresh.log")
    try:
        want = alone.chat(TURN2, max_tokens=DRAFT_TOKENS, logprobs=True)
    finally:
        alone.stop()
    assert cached(want) == 0
    server = draft_serve(model, draft, tmp_path / "store", tmp_path / "serve.log")
    try:
        server.chat(TURN1, max_tokens=DRAFT_TOKENS, logprobs=True)
        got = server.chat(TURN2, max_tokens=DRAFT_TOKENS, logprobs=True)
    finally:
        server.stop()
    assert cached(got) > 0, "turn 2 reused turn 1's cache from memory"
    assert answer(got) == answer(want)
    assert answer(got)[1] == fresh_prefill_answer(model, draft, TURN2)
    with persist.Store(tmp_path / "store") as s:  # every turn's cache was stored too
        assert s.stats().counters.get("serve_persist_errors", 0) == 0


def serve_turn(
    pc: PersistentPromptCache, key: Any, model: Any, tok: Any, draft: Any, prompt: list[int]
) -> Any:
    """One request as mlx-lm's server runs it (``ResponseGenerator._serve_single``):
    the nearest cache, speculative generation, the cache inserted under prompt +
    every generated token."""
    cache, rest = pc.fetch_nearest_cache(key, prompt)
    if cache is None:
        cache = make_prompt_cache(model) + make_prompt_cache(draft)
    tokens = list(prompt)
    for gen in stream_generate(
        model, tok, rest, max_tokens=DRAFT_TOKENS, draft_model=draft,
        num_draft_tokens=2, prompt_cache=cache,
    ):  # fmt: skip
        tokens.append(gen.token)
    pc.insert_cache(key, tokens, cache)
    return cache, rest


def test_memory_tier_caches_cover_their_keys(model_dir: Any, tmp_path: Path) -> None:
    """Every entry the memory tier keeps covers exactly its key, and a hit covers
    exactly the prompt tokens it claims (a fresh prefill of them has that many)."""
    model, tok = load(str(model_dir("llama")))
    draft, _ = load(str(model_dir("llama_hd64")))
    ident = persist.ModelIdentity.of(model, tok).with_draft(persist.ModelIdentity.of(draft))
    key = ("model", None, "draft")
    with persist.Store(tmp_path / "store") as store:
        pc = PersistentPromptCache(store=store, identity=ident)
        try:
            p1 = tok.apply_chat_template(TURN1, add_generation_prompt=True)
            serve_turn(pc, key, model, tok, draft, p1)
            for lru in pc._lru._lrus.values():
                for k, tokens in lru:
                    entry = pc._trie.get(k, tokens)
                    assert {c.offset for c in entry.prompt_cache} == {len(tokens)}
            p2 = tok.apply_chat_template(TURN2, add_generation_prompt=True)
            cache, rest = pc.fetch_nearest_cache(key, p2)
            assert cache is not None and len(rest) < len(p2)
            assert {c.offset for c in cache} == {len(p2) - len(rest)}
            pc.flush()
            assert pc.counters["persist_errors"] == 0  # the store took every insert
        finally:
            pc.close()


def test_a_draft_beside_an_untrimmable_model_is_refused_at_start(
    model_dir: Any, tmp_path: Path
) -> None:
    """Attack 39h: mlx-lm's speculative decoding refuses a recurrent model's cache in
    every request (a 500 each); persist serve refuses the setup in one line, exit 1."""
    from tests.helpers import persist_cli

    out = persist_cli(
        tmp_path / "home", "serve", "--model", str(model_dir("qwen3_next")), "--store",
        str(tmp_path / "s"), "--port", "0", "--draft-model", str(model_dir("qwen3_next_b")),
        check=False,
    )  # fmt: skip
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "--draft-model" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(("main", "draft"), [("gemma3", "llama"), ("llama", "gemma3")])
def test_a_draft_beside_a_sliding_window_model_is_refused_at_start(
    main: str, draft: str, model_dir: Any, tmp_path: Path
) -> None:
    """Attack r17b: past its window a ring cannot be trimmed, and mlx-lm's speculative
    decoding then trims nothing (silently): the rejected draft tokens stayed in every
    layer, and gemma3 answered wrong greedy tokens from its first token on."""
    from tests.helpers import persist_cli

    out = persist_cli(
        tmp_path / "home", "serve", "--model", str(model_dir(main)), "--store",
        str(tmp_path / "s"), "--port", "0", "--draft-model", str(model_dir(draft)),
        check=False,
    )  # fmt: skip
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "--draft-model" in out.stderr and "window" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_requests_draft_beside_a_sliding_window_model_is_refused(
    model_dir: Any, tmp_path: Path
) -> None:
    """The same with a request's own draft model (--allowed-models): refused every
    time, never served with the draft; the model alone still is."""
    from tests.serve.servers import post

    ring, plain = model_dir("gemma3"), model_dir("llama_hd64")
    srv = Server(
        [
            "persist", "serve", "--model", str(model_dir("llama")), "--store",
            str(tmp_path / "s"), "--allowed-models", f"{ring},{plain}",
        ],
        tmp_path / "serve.log",
    )  # fmt: skip
    try:
        asked = {"model": str(ring), "draft_model": str(plain), "max_tokens": 4}
        for _ in range(2):  # the second is refused too, not served by the loaded pair
            code, body = post(srv, "/v1/completions", {**asked, "prompt": "one two three"})
            assert code >= 400 and "window" in json.dumps(body), (code, body)
        code, body = post(srv, "/v1/completions", {"model": str(ring), "prompt": "a b"})
        assert code == 200, (code, body)
    finally:
        srv.stop()
