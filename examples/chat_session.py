"""A session that survives the process: restore it (or the best stored prefix),
stream the answer with mlx-lm, save it.  Run it twice: the second run prefills
only the new prompt.

    python examples/chat_session.py --model ./my-model --store ./cache "Hello there"
"""

from __future__ import annotations

import argparse

from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache

import persist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--session", default="chat")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    model, tokenizer = load(args.model)[:2]
    identity = persist.ModelIdentity.of(model, tokenizer)
    new = tokenizer.encode(args.prompt, add_special_tokens=False)

    with persist.Store(args.store) as store:
        try:  # the session itself, exactly as saved
            got = store.restore(args.session, identity=identity)
            cache, history, version = got.cache, got.tokens, got.entry.id
        except persist.SessionNotFoundError:  # else the longest prefix any session stored
            hit = store.lookup(new, identity=identity)
            cache, history, version = make_prompt_cache(model), [], 0
            if hit is not None:
                cache, history, new = hit.cache, hit.tokens, new[len(hit.tokens) :]
        print(f"restored {len(history)} tokens; prefilling {len(new)}")

        answer = []
        for response in stream_generate(
            model, tokenizer, new, max_tokens=args.max_tokens, prompt_cache=cache
        ):
            answer.append(response.token)
            print(response.text, end="", flush=True)
        print()
        # generate_step feeds each token to the cache before it yields it
        tokens = [*history, *new, *answer]
        entry = store.save(
            cache, tokens, identity=identity, session=args.session, if_version=version
        )
        print(f"saved session {entry.session!r}: {entry.tokens} tokens")


if __name__ == "__main__":
    main()
