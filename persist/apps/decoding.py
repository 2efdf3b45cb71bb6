"""One turn's generation: mlx-lm's ``generate_step`` with the identity's cache options
(kv_bits and its group size, where quantizing starts), the turn's sampling, and the
stops ``persist generate`` asks for between prefill chunks and after each token.

``apps.generate`` resumes the session, runs a turn here, and saves what the caches
hold; nothing here reads or writes the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any

import mlx.core as mx

from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from ..records import Progress

__all__ = ["Run", "Sampling"]


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: mlx_lm.generate's sampling options, same names and defaults.

    None of them changes what a cache holds (the cache covers the tokens, however
    they were drawn), so none is in the identity; they are reported with the turn."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    seed: int | None = None

    def sampler(self, tokenizer: Any) -> Callable[[Any], Any]:
        from mlx_lm.sample_utils import make_sampler

        if self.seed is not None:
            mx.random.seed(self.seed)
        return make_sampler(
            self.temp,
            self.top_p,
            self.min_p,
            self.min_tokens_to_keep,
            top_k=self.top_k,
            xtc_probability=self.xtc_probability,
            xtc_threshold=self.xtc_threshold,
            xtc_special_tokens=list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids),
        )


@dataclass(frozen=True)
class _Ran:
    """What a run left: the answer's tokens and text, seconds to the first token, and
    whether it was stopped (``prefilled``: stopped inside the prefill after so many of
    the prompt's tokens, which the caches then hold; None: the prefill ran whole)."""

    tokens: list[int]
    text: str
    first: float
    stopped: bool = False
    prefilled: int | None = None

    def __iter__(self) -> Iterator[Any]:
        # unpacks as the (tokens, text, first) a run returned before it could stop
        return iter((self.tokens, self.text, self.first))


class _PrefillStopped(Exception):
    """Asked to stop between two prefill chunks (the caches hold ``done`` prompt tokens)."""

    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


@dataclass(frozen=True)
class Run:
    """mlx-lm's generate_step with the identity's cache options and the sampling."""

    model: Any
    tokenizer: Any
    _: KW_ONLY
    identity: ModelIdentity
    sampling: Sampling
    prefill_step_size: int
    should_stop: Callable[[], bool] | None = None

    def _progress(self, bar: Progress | None) -> Progress:
        """The prefill's callback: the bar, then a stop between chunks.  Never at the
        last report (done == total): generate_step makes it after feeding the first
        answer token, which is not yielded yet."""

        def report(done: int, total: int) -> None:
            if bar is not None:
                bar(done, total)
            if done < total and self.should_stop is not None and self.should_stop():
                raise _PrefillStopped(done)

        return report

    def __call__(
        self,
        prompt: list[int],
        cache: list[Any],
        *,
        max_tokens: int,
        bar: Progress | None,
        on_text: Callable[[str], None] | None,
        t0: float,
    ) -> _Ran:
        from mlx_lm.generate import generate_step

        cfg = dict(self.identity.cache_config)
        steps = generate_step(
            mx.array(prompt),
            self.model,
            prompt_cache=cache,
            max_tokens=max_tokens,
            sampler=self.sampling.sampler(self.tokenizer),
            prompt_progress_callback=self._progress(bar),
            prefill_step_size=self.prefill_step_size,
            kv_bits=cfg.get("kv_bits"),
            kv_group_size=cfg.get("kv_group_size", 64),
            quantized_kv_start=cfg.get("quantized_kv_start", 5000),
        )
        try:
            return _decode(steps, self.tokenizer, on_text, t0, self.should_stop)
        except _PrefillStopped as e:
            return _Ran([], "", 0.0, stopped=True, prefilled=e.done)
        except ValueError as e:  # mlx's quantize refuses a group size the heads do not divide
            if "kv_bits" not in cfg or "quantiz" not in str(e):
                raise
            raise InvalidArgumentError(
                f"--kv-bits {cfg['kv_bits']} --kv-group-size {cfg.get('kv_group_size', 64)} "
                f"do not fit this model's caches: {str(e).splitlines()[0]}"
            ) from None


def _decode(
    steps: Any,
    tokenizer: Any,
    on_text: Callable[[str], None] | None,
    t0: float,
    should_stop: Callable[[], bool] | None = None,
) -> _Ran:
    """Run the generation steps to the end, an EOS or a stop (``should_stop``, asked
    after each token: every token yielded is in the caches already)."""
    detok = tokenizer.detokenizer
    detok.reset()
    out: list[int] = []
    first = 0.0
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    stopped = False
    for tok, _ in steps:
        if not out:
            first = time.perf_counter() - t0
        out.append(int(tok))  # generate_step fed it to the cache before yielding it
        if int(tok) in eos:
            break
        detok.add_token(int(tok))
        segment = detok.last_segment  # reading it consumes it
        if on_text is not None and segment:
            on_text(segment)
        if should_stop is not None and should_stop():
            stopped = True
            break
    detok.finalize()
    segment = detok.last_segment
    if on_text is not None and segment:
        on_text(segment)
    return _Ran(out, detok.text, first, stopped)
