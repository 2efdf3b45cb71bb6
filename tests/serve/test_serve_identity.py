"""``persist serve`` keys every durable entry by the model that computed it.

Round 1 keyed the durable tier on ``--model`` alone: a request naming another
model, a LoRA adapter or kv-bits options wrote caches that a later plain
server restored (same cached_tokens, other logprobs).  Each case here poisons
a store through a real ``persist serve``, restarts it with plain options and
compares every answer (text, token ids, logprobs) with plain mlx_lm.server's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import persist
from bench.servers import Server
from persist.apps.demo import make_model

QUESTION = [
    {"role": "system", "content": "You answer questions about the manual. " * 8},
    {"role": "user", "content": "What does section 2 say about the device?"},
]


def answer(resp: dict[str, Any]) -> tuple[str, list[int], list[float]]:
    choice = resp["choices"][0]
    content = choice["logprobs"]["content"]
    return (
        str(choice["message"]["content"]),
        [int(c["id"]) for c in content],
        [float(c["logprob"]) for c in content],
    )


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def ask(srv: Server, **extra: Any) -> dict[str, Any]:
    return srv.chat(QUESTION, max_tokens=8, logprobs=True, **extra)


def make_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter with non-zero weights, as mlx-lm's trainer would save it."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    model = load(str(model_dir))[0]
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(3)
    lora = {
        k: mx.random.normal(v.shape).astype(v.dtype) * 0.5
        for k, v in tree_flatten(model.parameters())
        if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), lora)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-models")
    a = make_model(root / "a", "llama", overrides={"head_dim": 32})
    b = make_model(root / "b", "llama", seed=1, overrides={"head_dim": 32})
    return {"a": a, "b": b, "adapter": make_adapter(a, root / "adapter")}


@pytest.fixture(scope="module")
def plain_answer(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("plain") / "plain.log"
    srv = Server(["mlx_lm.server", "--model", str(models["a"])], log)
    try:
        return answer(ask(srv))
    finally:
        srv.stop()


def persist_serve(model: Path, store: Path, log: Path, *options: str) -> Server:
    return Server(["persist", "serve", "--model", str(model), "--store", str(store), *options], log)


KV_BITS = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
POISONS: dict[str, tuple[tuple[str, ...], str | None, dict[str, Any]]] = {
    "another-model": ((), "b", {}),
    "adapter": (("--adapter-path", "{adapter}"), None, {"adapter_path": "{adapter}"}),
    "kv-bits": (
        ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"),
        None,
        KV_BITS,
    ),
}


def expected_identity(models: dict[str, Path], model: str, how: dict[str, Any]) -> str:
    how = {
        k: (v.format(adapter=models["adapter"]) if isinstance(v, str) else v)
        for k, v in how.items()
    }
    return persist.ModelIdentity.from_path(models[model], **how).digest


# kv-bits in the quick run; the other two (8 and 7 s of servers) are long: the same restart
@pytest.mark.parametrize(
    "case", [c if c == "kv-bits" else pytest.param(c, marks=pytest.mark.long) for c in POISONS]
)
def test_a_plain_restart_never_restores_what_another_setup_computed(
    case: str, models: dict[str, Path], plain_answer: Any, tmp_path: Path
) -> None:
    options, request_model, how = POISONS[case]
    opts = [o.format(adapter=models["adapter"]) for o in options]
    store = tmp_path / "store"
    extra = {"model": str(models[request_model])} if request_model else {}
    if request_model:  # a request may name another model only if the operator allowed it
        opts += ["--allowed-models", str(models[request_model])]
    first = persist_serve(models["a"], store, tmp_path / "a.log", *opts)
    try:
        poisoned = answer(ask(first, **extra))
    finally:
        first.stop()
    assert poisoned != plain_answer, "the poisoning setup must compute something else"
    with persist.Store(store) as s:
        # every entry is keyed by the model (and options) that computed it
        assert {e.identity for e in s.entries()} == {
            expected_identity(models, request_model or "a", how)
        }
    again = persist_serve(models["a"], store, tmp_path / "b.log")
    try:
        resp = ask(again)
    finally:
        again.stop()
    assert cached(resp) == 0
    assert answer(resp) == plain_answer
    if case == "adapter":  # the same setup again does reuse its own entries
        same = persist_serve(models["a"], store, tmp_path / "c.log", *opts)
        try:
            resp = ask(same)
        finally:
            same.stop()
        assert cached(resp) > 0 and answer(resp) == poisoned


def test_repeated_identical_requests_keep_the_store_bounded(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """250 identical requests left 252 rows in round 1; now one entry per distinct prefix."""
    store = tmp_path / "store"
    srv = persist_serve(models["a"], store, tmp_path / "a.log")
    try:
        for _ in range(12):
            ask(srv)
    finally:
        srv.stop()
    with persist.Store(store) as s:
        assert len(s.entries()) <= 2, [e.tokens for e in s.entries()]
        c = s.stats().counters
        # the first request's caches were stored; the same tokens again are not captured
        # (a request that gains nothing costs nothing), counted as skipped
        assert c.get("serve_persisted", 0) >= 1 and c.get("serve_captures_skipped", 0) >= 11
        assert s.check() == []
