"""An in-process mlx-lm generator's inputs, for the tests of the generation thread:
the server's parsed command line and one text completion request."""

from __future__ import annotations

import argparse
from typing import Any

import mlx_lm.server as server


def cli_args(model: str) -> argparse.Namespace:
    return argparse.Namespace(
        model=model, adapter_path=None, draft_model=None, trust_remote_code=False,
        chat_template="", use_default_chat_template=False, pipeline=False,
        prompt_cache_bytes=None, prompt_cache_size=10, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, decode_concurrency=32, prompt_concurrency=8,
        prefill_step_size=2048, chat_template_args={}, max_tokens=8, num_draft_tokens=3,
        temp=0.0, top_p=1.0, top_k=0, min_p=0.0, allowed_origins=["*"],
    )  # fmt: skip


def request(prompt: str, logit_bias: dict[int, float] | None = None) -> tuple[Any, Any]:
    req = server.CompletionRequest("text", prompt, [], None, None)
    args = server.GenerationArguments(
        model=server.ModelDescription("default_model", "default_model", None),  # type: ignore[arg-type]
        sampling=server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.0),
        logits=server.LogitsProcessorArguments(logit_bias, 0.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[], max_tokens=4, num_draft_tokens=3, logprobs=False,
        top_logprobs=-1, seed=None, chat_template_kwargs=None,
    )  # fmt: skip
    return req, args
