"""The prompt of ``generate``, ``prime`` and ``explain``: ``--prompt`` (``-``: stdin) or
``--prompt-file``, taken as UTF-8 text no larger than the model's context can hold.

Round 5: a prompt that was not UTF-8 (a file, stdin, or argv bytes that Python
escaped) was a traceback, exit 3; a prompt file of hundreds of MB was read and
tokenized whole (GBs) before anything refused it.  Now a prompt that is not
UTF-8 is an InvalidArgumentError naming the first bad byte's offset, and a
prompt is refused by its size in bytes before it is read: at most
PROMPT_BYTES_PER_TOKEN bytes for each token of the model's context.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import click

from ..errors import InvalidArgumentError
from ..records import MAX_TOKENS
from ..serve.bounds import context_length

__all__ = [
    "PROMPT_BYTES_PER_TOKEN", "Prompt", "given_prompt", "prompt_limit", "read_prompt",
    "utf8_argument", "prompt_option", "prompt_file_option",
]  # fmt: skip

# English runs 4-5 bytes a token, code 3-4, CJK 3-6: a text this many bytes a token
# on average is runs of one character, far past what a context takes anyway
PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class Prompt:
    """Where the prompt comes from, checked before the model loads (``read_prompt``
    reads it once the model's context is known)."""

    text: str | None  # --prompt, its bytes already checked
    path: Path | None  # --prompt-file; neither: stdin
    where: str  # what messages call it


def utf8(data: bytes, where: str) -> str:
    """``data`` as text; InvalidArgumentError naming the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(
            f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} "
            f"({e.reason}); persist reads prompts as UTF-8 (iconv -t UTF-8 converts a file)"
        ) from None


def utf8_argument(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: an argument whose bytes were not UTF-8 (Python hands them on
    as lone surrogates, which no tokenizer takes) is refused, exit 1."""
    if value is None:
        return None
    where = f"the {param.opts[0]} argument"
    try:
        data = value.encode("utf-8", "surrogateescape")  # the bytes the shell passed
    except UnicodeEncodeError as e:  # a surrogate no escape made: not from argv bytes
        raise InvalidArgumentError(f"{where} is not text: character {e.start} is a lone "
                                   "surrogate") from None  # fmt: skip
    return utf8(data, where)


prompt_option = click.option(
    "--prompt",
    "-p",
    default=None,
    callback=utf8_argument,
    help="Text appended to the session ('-' reads stdin).",
)
prompt_file_option = click.option(
    "--prompt-file",
    type=click.Path(exists=True, dir_okay=False, readable=True, allow_dash=True, path_type=Path),
    default=None,
    help="A file to read the prompt from ('-': stdin); UTF-8 text.",
)


def given_prompt(prompt: str | None, prompt_file: Path | None) -> Prompt:
    """Exactly one of --prompt and --prompt-file; ``\\n`` and ``\\t`` in --prompt as
    mlx_lm.generate reads them."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None and str(prompt_file) != "-":
        return Prompt(None, prompt_file, f"the prompt file {prompt_file}")
    if prompt_file is not None or prompt == "-":
        return Prompt(None, None, "the prompt on stdin")
    assert prompt is not None
    return Prompt(prompt.replace("\\n", "\n").replace("\\t", "\t"), None, "the --prompt argument")


def prompt_limit(model: Any) -> tuple[int, str]:
    """The most bytes a prompt for ``model`` may have, and what bounds it."""
    context = context_length(model)
    if context is None:  # a recurrent model states none: what a session may hold
        return MAX_TOKENS * PROMPT_BYTES_PER_TOKEN, f"a session of {MAX_TOKENS:,} tokens"
    return context * PROMPT_BYTES_PER_TOKEN, f"a context of {context:,} tokens"


def read_prompt(given: Prompt, model: Any) -> str:
    """The prompt's text, refused by its size before more than the limit is read."""
    limit, bound = prompt_limit(model)

    def too_large(size: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{given.where} is {size} bytes; {bound} holds at most {limit:,} "
            f"({PROMPT_BYTES_PER_TOKEN} bytes a token, a generous bound)"
        )

    if given.text is not None:
        size = len(given.text.encode("utf-8"))
        if size > limit:
            raise too_large(f"{size:,}")
        return given.text
    if given.path is None:
        data = _read_at_most(sys.stdin.buffer, limit, too_large)
        return utf8(data, given.where)
    try:
        with open(given.path, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size > limit:  # refused unread
                raise too_large(f"{st.st_size:,}")
            data = _read_at_most(f, limit, too_large)  # a FIFO, or a file that grew
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {given.where}: {e.strerror}") from None
    return utf8(data, given.where)


def _read_at_most(
    f: IO[bytes], limit: int, too_large: Callable[[str], InvalidArgumentError]
) -> bytes:
    data = f.read(limit + 1)
    if len(data) > limit:
        raise too_large(f"more than {limit:,}")
    return data
