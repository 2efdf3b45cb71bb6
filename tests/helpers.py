"""Helpers shared by the tests: tiny models, prefill, continuation, bitwise compare."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from persist.codecs import encode_cache
from persist.format.manifest import tensor_keys
from persist.format.tensors import on_cuda

ROOT = Path(__file__).resolve().parent.parent
NEXT = [17, 200, 3, 99]


def tokens_for(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def prefill(
    model: Any, tokens: Sequence[int], cache: list[Any] | None = None, step: int = 128
) -> tuple[list[Any], mx.array]:
    """Run ``tokens`` through the model in chunks; return the cache and last logits."""
    cache = make_prompt_cache(model) if cache is None else cache
    logits = None
    for i in range(0, len(tokens), step):
        logits = model(mx.array([list(tokens[i : i + step])]), cache=cache)
        mx.eval(logits, [c.state for c in cache])
    assert logits is not None
    return cache, logits[0, -1]


def continue_run(
    model: Any, cache: list[Any], next_tokens: Sequence[int], n_greedy: int = 8
) -> tuple[list[mx.array], list[int]]:
    """Feed ``next_tokens`` one at a time, then decode ``n_greedy`` tokens greedily.

    Returns the logits of every step and the greedy tokens.
    """
    logits_seen = []
    logits = None
    for t in next_tokens:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits)
        logits_seen.append(logits)
    greedy = []
    for _ in range(n_greedy):
        assert logits is not None
        t = int(mx.argmax(logits).item())
        greedy.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits)
        logits_seen.append(logits)
    return logits_seen, greedy


def raw(a: mx.array) -> bytes:
    if a.size == 0:
        return b""  # dtype and shape are compared beside the bytes
    a = mx.contiguous(a) if a.ndim else a.reshape(1)
    mx.eval(a)
    return bytes(memoryview(a).cast("B"))


def live_state(cache: list[Any]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every layer's live tensors (as persist encodes them), as comparable bytes."""
    recs = [encode_cache(c) for c in cache]
    out = {}
    for key, rec, name in tensor_keys(recs):
        a = rec.tensors[name]
        out[key] = (str(a.dtype), tuple(a.shape), raw(a))
    metas = {str(i): repr(_metas(r)) for i, r in enumerate(recs)}
    out["__meta__"] = ("", (), repr(metas).encode())
    return out


def _metas(rec: Any) -> Any:
    return (rec.kind, rec.meta, [_metas(c) for c in rec.children])


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], f"state differs at {k}"


def pythonpath() -> str:
    """The checkout first, then what the caller had (an MLX installed with --target)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def run_child(model_dir: Path, jobs: list[dict[str, Any]], tmp: Path) -> None:
    job = tmp / "job.json"
    job.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    subprocess.run(
        [sys.executable, "-m", "tests.child_continue", str(model_dir), str(job)],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )


def decode_state(meta: str) -> dict[str, Any]:
    return {k: (v[0], tuple(v[1]), bytes.fromhex(v[2])) for k, v in json.loads(meta).items()}


def check_against_child(
    model: Any,
    cache: list[Any],
    out: Path,
    prompt: list[int],
    *,
    state: bool = True,
    next_tokens: list[int] | None = None,
) -> None:
    """Continue ``cache`` here and compare with what the child computed.

    ``state=False`` compares only logits and greedy tokens (for a reference
    run whose ring may be laid out differently but must compute the same).
    """
    arrays, meta = mx.load(str(out), return_metadata=True)
    assert json.loads(meta["tokens"]) == prompt
    if state:
        assert_same_state(live_state(cache), decode_state(meta["before"]))
    nxt = NEXT if next_tokens is None else next_tokens
    if ON_CUDA:
        _close_on_cuda(model, cache, nxt, arrays)
        return
    logits, greedy = continue_run(model, cache, nxt)
    assert greedy == json.loads(meta["greedy"])
    assert len(logits) == len(nxt) + 8
    for i, x in enumerate(logits):
        assert raw(x) == raw(arrays[f"logits.{i}"]), f"logits differ at step {i}"
    if state:
        assert_same_state(live_state(cache), decode_state(meta["after"]))


# MLX's CUDA kernels do not promise bit-identical results for the same values in
# differently allocated buffers (a cache trimmed by one token and extended again
# shows it, without persist): there the state is compared byte for byte (above)
# and the logits of the fed tokens within this tolerance, relative to their scale.
ON_CUDA = on_cuda()
CUDA_RTOL = 2e-2
# MLX 0.32's CUDA quantized_matmul has no kernel for the tiny models' shapes
# ("No implementation for problem shape: 64x128x64x4"): kv_bits caches cannot be built
NO_KV_BITS_HERE = "MLX's CUDA quantized_matmul lacks the tiny models' shapes"


def another_backend(here: str) -> str:
    """A backend that is not this machine's (for identities "saved elsewhere")."""
    return "metal:Apple M2 Max" if here.split(":")[0] != "metal" else "cuda:NVIDIA H200"


def _close_on_cuda(model: Any, cache: list[Any], nxt: list[int], arrays: dict[str, Any]) -> None:
    logits, _ = continue_run(model, cache, nxt, n_greedy=0)
    for i, x in enumerate(logits):
        want = arrays[f"logits.{i}"].astype(mx.float32)
        scale = float(mx.abs(want).max().item()) or 1.0
        err = float(mx.abs(x.astype(mx.float32) - want).max().item())
        assert err <= CUDA_RTOL * scale, f"logits differ at step {i}: {err} of {scale}"


def kv_quantized(
    model: Any, prompt: list[int], start: int, bits: int = 4, group: int = 32
) -> list[Any]:
    """A cache that mlx-lm's generate_step converts to QuantizedKVCache at ``start``."""
    if ON_CUDA:
        pytest.skip(NO_KV_BITS_HERE)
    cache = make_prompt_cache(model)
    for _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=0,
        prompt_cache=cache,
        kv_bits=bits,
        kv_group_size=group,
        quantized_kv_start=start,
        prefill_step_size=64,
    ):
        pass
    return cache


def persist_cli(
    home: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m persist ARGS`` as a user runs it, with PERSIST_HOME=home."""
    full = {**os.environ, "PERSIST_HOME": str(home), "PYTHONPATH": pythonpath(), **(env or {})}
    out = subprocess.run(
        [sys.executable, "-m", "persist", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out
