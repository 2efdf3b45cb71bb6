"""Restore or recompute: prefill time beside restore time, on a real model, one run.

    python -m bench.bench_recompute                  # Llama-3-8B shape, 8k and 32k tokens
    python -m bench.bench_recompute --lengths 8192 32768 131072
    python -m bench.bench_recompute --shape small    # a 24M-parameter llama (CPU smoke run)
    python -m bench.bench_recompute --shape qwen3-next --lengths 8192 --warmup 4096

A random-weight model of the Llama-3-8B shape (bf16) prefills n tokens (after
a warm-up run of that length, which compiles kernels); the cache is saved into
a store and restored, and the first decode step runs on it, with the page cache
warm and cold.  Also the decode-step time on a cache before and after a save
(saving reads the cache on the host; it must not slow later steps).  The
prefills go through ``persist.prefill`` and the restores through the store, so
its cost model measures them, and a last lookup reports the restore-or-recompute
decision those rates give.  Results in bench/results/recompute-<device>[-shape].json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

import persist
from bench.common import LLAMA3_8B, RESULTS, SMALL_LLAMA, evict, warm
from persist.identity.model_facts import current_backend

IDENTITY = persist.ModelIdentity("bench", "c", "w", "t", "h", name="bench")
CHUNK = 2048


def build(shape: dict[str, Any]) -> Any:
    args = llama.ModelArgs(
        model_type="llama",
        vocab_size=32000,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **shape,
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


# Qwen3-Next-80B-A3B's layer shapes (48 layers, every 4th full attention with 2 KV heads
# of 256, the rest gated-DeltaNet), with 16 experts instead of 512 (10 active per token,
# as there): the same cache and per-token compute, a tenth of the weights.
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 512,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "vocab_size": 32000,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 262144,
}
SMALL_QWEN3_NEXT = {
    **QWEN3_NEXT,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "head_dim": 64,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    "small": SMALL_LLAMA,
    "qwen3-next": QWEN3_NEXT,
    "qwen3-next-small": SMALL_QWEN3_NEXT,
}


def build_qwen3_next(shape: dict[str, Any]) -> Any:
    from mlx_lm.models import qwen3_next

    model = qwen3_next.Model(qwen3_next.ModelArgs(**shape))
    # MLX's CPU gather_mm (the experts) takes float32 only: a CPU smoke run uses it
    model.set_dtype(mx.float32 if device() == "cpu" else mx.bfloat16)
    mx.eval(model.parameters())
    return model


def prefill(model: Any, tokens: mx.array) -> tuple[list[Any], float]:
    cache = make_prompt_cache(model)
    mx.synchronize()
    t = time.perf_counter()
    for i in range(0, tokens.size, CHUNK):
        logits = model(tokens[None, i : i + CHUNK], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    mx.synchronize()
    return cache, time.perf_counter() - t


def step(model: Any, cache: list[Any]) -> float:
    mx.synchronize()
    t = time.perf_counter()
    logits = model(mx.array([[7]]), cache=cache)
    mx.eval(logits)
    mx.synchronize()
    return time.perf_counter() - t


def measured_prefill(
    model: Any, tokens: list[int], store: persist.Store, ident: persist.ModelIdentity
) -> tuple[list[Any], float]:
    """persist.prefill into the store's cost model: its forwards are the prefill rates."""
    mx.synchronize()
    t = time.perf_counter()
    cache = persist.prefill(model, tokens, store=store, identity=ident, step=CHUNK)
    mx.synchronize()
    return cache, time.perf_counter() - t


def one(model: Any, n: int, tmp: Path, warmup: int | None) -> dict[str, Any]:
    tokens = mx.random.randint(0, 32000, (n,))
    prefill(model, tokens[: warmup or n])  # warm-up: kernels for this shape
    ident = dataclasses.replace(IDENTITY, backend=current_backend())
    with persist.Store(tmp / "store") as store:
        cache, first = measured_prefill(model, tokens.tolist(), store, ident)
        _, again = measured_prefill(model, tokens.tolist(), store, ident)
        before = min(step(model, cache) for _ in range(5))
        toks = [*tokens.tolist(), *[7] * 5]  # step() feeds token 7
        t = time.perf_counter()
        store.save(cache, toks, identity=ident, session="s")
        save_s = time.perf_counter() - t
        after = min(step(model, cache) for _ in range(5))
        files = list((tmp / "store" / "blobs").rglob("*.safetensors"))
        out: dict[str, Any] = {"steps": float("inf")}
        for mode in ("warm", "cold", "warm", "cold"):
            if mode == "cold":
                for p in files:
                    evict(p)
            gc.collect()
            t = time.perf_counter()
            restored = store.restore("s", identity=ident).cache  # timed by the cost model too
            step(model, restored)
            dt = time.perf_counter() - t
            out[mode] = min(out.get(mode, float("inf")), dt)
            out["steps"] = min(out["steps"], *(step(model, restored) for _ in range(5)))
            del restored
        nbytes = store.stats().unique_bytes
        for p in files:  # the decision a new prompt sharing these tokens gets, cold
            evict(p)
        t = time.perf_counter()
        hit = store.lookup([*toks, 9, 9], identity=ident)
        lookup_s = time.perf_counter() - t
        decision = store.costs.last
        del hit
        for p in files:  # and warm: the page cache holds the blobs (the "local" rate)
            warm(p)
        hit = store.lookup([*toks, 9, 9], identity=ident)
        warm_decision = store.costs.last
        del hit
    prefill_s = min(first, again)
    return {
        "tokens": n,
        "cache_bytes": nbytes,
        "prefill_s": prefill_s,
        "save_s": save_s,
        "restore_step_warm_s": out["warm"],
        "restore_step_cold_s": out["cold"],
        "decode_step_before_save_s": before,
        "decode_step_after_save_s": after,
        "decode_step_after_restore_s": out["steps"],  # against before: no managed memory
        "restore_wins": out["cold"] < prefill_s,
        # the cost model's decision for a prompt of these tokens and more, from the rates
        # the runs above measured; lookup_s is what taking (or declining) it cost
        "decision": None if decision is None else dataclasses.asdict(decision),
        "decision_warm": None if warm_decision is None else dataclasses.asdict(warm_decision),
        "lookup_s": lookup_s,
    }


def device() -> str:
    d = mx.default_device()
    if d.type == mx.gpu and mx.cuda.is_available():
        return "cuda"
    return "metal" if d.type == mx.gpu else "cpu"


def device_name(label: str) -> str:
    if label == "cuda":
        import subprocess

        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            return out.stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "NVIDIA GPU"
    return platform.processor() or platform.machine()


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"# Restore or recompute ({m['device']}: {m['device_name']}, {m['shape']} shape, bf16)",
        "",
        "Decision: what `Store.lookup` chose for a prompt of these tokens and two more, "
        "from the rates this run measured (two prefills, four restores, warm and cold); "
        "the predicted seconds beside it.",
        "",
        "| tokens | cache | prefill | restore + step (warm) | restore + step (cold) | "
        "prefill / cold restore | decode step before / after a save | decode step after "
        "a restore / after the prefill | decision, blobs on disk (predicted restore / "
        "prefill) | decision, blobs in the page cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        lines.append(
            f"| {c['tokens']} | {c['cache_bytes'] / 2**30:.2f} GiB | {c['prefill_s']:.3f} s "
            f"| {c['restore_step_warm_s']:.3f} s | {c['restore_step_cold_s']:.3f} s "
            f"| {c['prefill_s'] / c['restore_step_cold_s']:.2f}x "
            f"| {c['decode_step_before_save_s'] * 1e3:.1f} / "
            f"{c['decode_step_after_save_s'] * 1e3:.1f} ms | {_steps(c)} "
            f"| {_decision(c.get('decision'))} | {_decision(c.get('decision_warm'))} |"
        )
    return "\n".join(lines) + "\n"


def _steps(c: dict[str, Any]) -> str:
    if "decode_step_after_restore_s" not in c:
        return "n/a"
    after, before = c["decode_step_after_restore_s"], c["decode_step_before_save_s"]
    return f"{after * 1e3:.1f} / {before * 1e3:.1f} ms ({after / before:.2f}x)"


def _decision(d: dict[str, Any] | None) -> str:
    if d is None:
        return "n/a"
    got = (d["restore_s"], d["prefill_s"])
    pred = [f"{v:.2f} s" if v is not None else "unmeasured" for v in got]
    return f"{'restore' if d['restore'] else 'recompute'} ({pred[0]} / {pred[1]})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up tokens (default: n)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    model = build_qwen3_next(shape) if "model_type" in shape else build(shape)
    label = device()
    name = device_name(label)
    cases = []
    for n in args.lengths:
        tmp = Path(
            tempfile.mkdtemp(dir=os.environ.get("PERSIST_BENCH_TMP") or Path(__file__).parent)
        )
        try:
            cases.append(one(model, n, tmp, args.warmup))
            print(json.dumps(cases[-1]), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    r = {
        "machine": {
            "platform": platform.platform(),
            "device": label,
            "device_name": str(name),
            "shape": args.shape,
        },
        "cases": cases,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = f"recompute-{label}" + ("" if args.shape == "llama3-8b" else f"-{args.shape}")
    (RESULTS / f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
