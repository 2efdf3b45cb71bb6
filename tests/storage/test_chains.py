"""Chain hashes alone: tokens only, keyed by the namespace secret and the identity."""

from __future__ import annotations

from persist.storage.chains import HEAD_TOKENS, chain_root, chains, head_key

TOKS = list(range(1000))


def test_chains_depend_on_tokens_secret_and_identity() -> None:
    root = chain_root(b"s" * 32, "model")
    assert chain_root(b"t" * 32, "model") != root and chain_root(b"s" * 32, "other") != root
    c = chains(root, TOKS, 256)
    assert len(c) == 1 + 1000 // 256 and c[0] == root
    assert chains(root, TOKS[:600], 256) == c[:3]  # a prefix shares its chains
    changed = chains(root, [*TOKS[:300], 7, *TOKS[301:]], 256)
    assert changed[:2] == c[:2] and changed[2] != c[2]


def test_head_keys_of_short_lists_match_no_prompt() -> None:
    root = chain_root(b"s" * 32, "model")
    assert head_key(root, TOKS[:HEAD_TOKENS]) == head_key(root, TOKS)
    assert head_key(root, TOKS[: HEAD_TOKENS - 1]) != head_key(root, TOKS)
