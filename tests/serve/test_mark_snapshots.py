"""A ``cache_control`` mark inside a conversation gives a recurrent model a snapshot there.

mlx-lm's server stores a cache at the end of each prompt segment (the system
prompt, the rest); an attention cache can be cut back to any prefix, a recurrent
one (gated DeltaNet, Mamba) only resumes where a snapshot was taken.  So a mark
on a later message (an agent's tool results, a document the client will ask
about again) protected nothing a hybrid model could reuse.  persist serve now
cuts mlx-lm's segments at each mark for such models.  Real server processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from persist.serve.hints import split_at_marks
from tests.serve.servers import cached, persist_serve, post

MARK = {"type": "ephemeral", "ttl": "1h"}
SYSTEM = "You are a careful assistant for the warehouse. " * 3


def turns(last: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Here is the inventory: bolts 40, nuts 12, gears 7. " * 3},
        {"role": "assistant", "content": "Noted the inventory.", "cache_control": MARK},
        {"role": "user", "content": last},
    ]


def chat(srv: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}  # fmt: skip
    code, answer = post(srv, "/v1/chat/completions", body)
    assert code == 200, answer
    return answer


def mark_cut(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    """Where the marked message ends in the prompt, as persist serve computes it."""
    plain = [{k: v for k, v in m.items() if k != "cache_control"} for m in messages]
    prompt = tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    head = tokenizer.apply_chat_template(plain[:3], add_generation_prompt=False)
    diverge = (i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b)
    return next(diverge, min(len(head), len(prompt)))


def test_a_mark_inside_the_conversation_is_where_a_hybrid_model_resumes(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    _, tokenizer, folder = tiny("qwen3_next")
    later = turns("How many gears are left after selling two?")
    cut = mark_cut(tokenizer, later)
    srv = persist_serve(folder, tmp_path / "store", tmp_path / "a.log")
    try:
        chat(srv, turns("How many bolts are there?"))
        hit = chat(srv, later)
    finally:
        srv.stop()
    assert cached(hit) == cut  # before: the system prompt's end only
    fresh = persist_serve(folder, tmp_path / "fresh", tmp_path / "b.log")
    try:
        alone = chat(fresh, later)  # the same request on a server that saw nothing
    finally:
        fresh.stop()
    assert cached(alone) == 0
    assert hit["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]


@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=4),
    st.lists(st.integers(-2, 40), max_size=5),
)
def test_marks_cut_segments_and_keep_the_prompt(sizes: list[int], marks: list[int]) -> None:
    segments = [list(range(sum(sizes[:i]), sum(sizes[: i + 1]))) for i in range(len(sizes))]
    kinds = [f"k{i}" for i in range(len(sizes))]
    out, out_kinds = split_at_marks(segments, kinds, marks)
    assert [t for s in out for t in s] == [t for s in segments for t in s]
    assert all(out) and len(out) == len(out_kinds)
    ends = {sum(len(s) for s in out[: i + 1]) for i in range(len(out))}
    total = sum(sizes)
    assert {m for m in marks if 0 < m < total} <= ends  # every mark inside is an end
    old_ends = {sum(sizes[: i + 1]) for i in range(len(sizes))}
    assert ends == old_ends | {m for m in marks if 0 < m < total}  # and nothing else is
