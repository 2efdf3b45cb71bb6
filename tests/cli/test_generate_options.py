"""``persist generate`` takes mlx_lm.generate's options, with their names and meanings:
the prompt from stdin or a file, sampling (not in the identity), cache options (in it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import persist
from persist.apps.demo import make_model
from persist.apps.generate import load_model
from persist.cli import cli
from persist.cli.prompts import PROMPT_BYTES_PER_TOKEN
from tests.helpers import NO_KV_BITS_HERE, ON_CUDA, pythonpath


def run(*args: str, input: str | None = None, code: int = 0) -> Any:
    res = CliRunner().invoke(cli, list(args), input=input)
    assert res.exit_code == code, res.output
    return res


def gen(m: Path, store: Path, session: str, *more: str, input: str | None = None) -> Any:
    args = ["generate", "--model", str(m), "--store", str(store), "--session", session]
    return json.loads(run(*args, *more, "--json", input=input).stdout)


def test_the_prompt_comes_from_stdin_or_a_file(tmp_path: Path, tiny: Any) -> None:
    """`--prompt -` was stored as the one-character prompt '-'."""
    _, tok, m = tiny("llama")
    store = tmp_path / "s"
    text = "a prompt piped in\nover two lines"
    r = gen(m, store, "piped", "--prompt", "-", "-m", "3", input=text)
    assert r["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    f = tmp_path / "prompt.txt"
    f.write_text(text)
    r2 = gen(m, store, "filed", "--prompt-file", str(f), "-m", "3")
    assert r2["prompt_tokens"] == r["prompt_tokens"] and r2["text"] == r["text"]
    r3 = gen(m, store, "escaped", "--prompt", "a prompt piped in\\nover two lines", "-m", "3")
    assert r3["prompt_tokens"] == r["prompt_tokens"]  # \\n as mlx_lm.generate reads it
    res = run("generate", "--model", str(m), "--store", str(store), "--session", "x", code=2)
    assert "exactly one of --prompt and --prompt-file" in res.output


def test_sampling_options_and_the_seed(tmp_path: Path, tiny: Any) -> None:
    _, _, m = tiny("llama")
    store = tmp_path / "s"
    hot = ("--prompt", "Hello there", "-m", "16", "--temp", "2.0", "--top-p", "0.9")
    a = gen(m, store, "a", *hot, "--seed", "1")
    b = gen(m, store, "b", *hot, "--seed", "1")
    c = gen(m, store, "c", *hot, "--seed", "2")
    assert a["text"] == b["text"] != c["text"]  # the seed decides, as in mlx-lm
    assert a["sampling"] == {
        "temp": 2.0, "top_p": 0.9, "min_p": 0.0, "top_k": 0, "min_tokens_to_keep": 1,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "seed": 1,
    }  # fmt: skip
    # sampling is not in the identity: another temperature continues the session
    d = gen(m, store, "a", "--prompt", " more", "-m", "2", "--min-p", "0.1")
    assert d["source"] == "session" and d["reused_tokens"] == a["session_tokens"]


def test_cache_options_are_in_the_identity(tmp_path: Path, tiny: Any) -> None:
    if ON_CUDA:
        pytest.skip(NO_KV_BITS_HERE)
    store = tmp_path / "s"
    small = tiny("llama")[2]  # heads of 16: no group size of MLX's divides them
    bad = ("generate", "--model", str(small), "--store", str(store), "--session", "b", "-p", "Hi")
    res = run(*bad, "--kv-bits", "4", "--quantized-kv-start", "0", code=1)
    assert "--kv-group-size 64) do not fit" in res.output
    m = tiny("llama_hd64")[2]
    q = ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    r = gen(m, store, "q", *q, "--prompt", "Hello there, a quantized cache", "-m", "4")
    with persist.Store(store) as s:
        e = s.entry("q")
        assert set(e.kinds) == {"quantized-kv"}, e.kinds
    cfg = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
    ident = load_model(m, **cfg)[2]
    assert e.identity == ident.digest and dict(ident.cache_config) == cfg
    more = ("--prompt", " and more", "-m", "2")
    again = gen(m, store, "q", *q, *more)
    assert again["source"] == "session" and again["reused_tokens"] == r["session_tokens"]
    args = ("generate", "--model", str(m), "--store", str(store), "--session", "q", *more)
    res = run(*args, code=1)  # without --kv-bits: another cache, refused with the reason
    assert "cache_config.kv_bits" in res.output and "--kv-bits" in res.output
    # --max-kv-size as mlx-lm means it: a ring for models without caches of their own
    # (this llama makes its own, so mlx-lm ignores it), and in the identity either way
    w = gen(m, store, "w", "--max-kv-size", "64", "--prompt", "x " * 60, "-m", "4")
    w2 = gen(m, store, "w", "--max-kv-size", "64", "--prompt", " y", "-m", "2")
    assert w2["source"] == "session" and w2["reused_tokens"] == w["session_tokens"]
    res = run(*args[:6], "w", "--prompt", " z", code=1)
    assert "cache_config.max_kv_size" in res.output


def test_chat_options_as_mlx_lm_names_them(tmp_path: Path, tiny: Any) -> None:
    _, tok, m = tiny("llama")
    store = tmp_path / "s"
    chat = ("--chat", "--system-prompt", "Be brief.", "--prompt", "Hi", "-m", "3")
    r = gen(m, store, "c", *chat, "--chat-template-config", "{}")
    want = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert r["prompt_tokens"] == len(want)
    bad = ("generate", "--model", str(m), "--store", str(store), "--session", "d")
    res = run(*bad, *chat, "--chat-template-config", "[1", code=2)
    assert "--chat-template-config" in res.output and "not JSON" in res.output


def generate_bytes(
    home: Path, m: Path, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    """``persist generate`` in a real process, its stdin given as bytes."""
    env = {**os.environ, "PERSIST_HOME": str(home), "PYTHONPATH": pythonpath()}
    cmd = [sys.executable, "-m", "persist", "generate", "--model", str(m), "--session", "s"]
    return subprocess.run(
        [*cmd, "-m", "2", *args], input=stdin, env=env, capture_output=True, timeout=300
    )


NOT_UTF8 = b"hello \xff\xfe world"  # 0xff cannot start a UTF-8 sequence: byte offset 6


@pytest.mark.parametrize("given", ["file", "stdin", "argument"])
def test_a_prompt_that_is_not_utf8_names_its_byte_offset(
    tmp_path: Path, model_dir: Any, given: str
) -> None:
    f = tmp_path / "prompt.txt"
    f.write_bytes(NOT_UTF8)
    args = {
        "file": ("--prompt-file", str(f)),
        "stdin": ("--prompt", "-"),
        "argument": ("--prompt", os.fsdecode(NOT_UTF8)),  # argv as Python gets it: escaped
    }[given]
    out = generate_bytes(tmp_path / "home", model_dir("llama"), *args, stdin=NOT_UTF8)
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err, err
    assert "is not UTF-8 text: byte 0xff at byte offset 6" in err


CONTEXT = 256  # tokens: the bound of a prompt is 8 KiB


@pytest.fixture(scope="module")
def short_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama that states its context (the shared one states none)."""
    d = tmp_path_factory.mktemp("short") / "llama"
    return make_model(d, "llama", overrides={"max_position_embeddings": CONTEXT})


def test_a_prompt_file_longer_than_the_context_holds_is_refused(
    tmp_path: Path, short_context: Path
) -> None:
    limit = CONTEXT * PROMPT_BYTES_PER_TOKEN
    f = tmp_path / "prompt.txt"
    f.write_bytes(b"a" * (limit + 1))
    out = generate_bytes(tmp_path / "home", short_context, "--prompt-file", str(f))
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err, err
    assert f"is {limit + 1:,} bytes; a context of {CONTEXT} tokens holds at most {limit:,}" in err


def peak_rss_of(*args: str) -> int:
    """The peak RSS in bytes of ``persist ARGS`` run in a fresh process."""
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run([sys.executable, '-m', 'persist', *sys.argv[1:]], capture_output=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    ran = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, timeout=300
    )
    return int(ran.stdout) * 1024


def test_a_huge_prompt_file_is_refused_before_it_is_read(
    tmp_path: Path, short_context: Path
) -> None:
    """Round 5: a prompt file of hundreds of MB was read and tokenized whole (GBs)."""
    small, huge = tmp_path / "small.txt", tmp_path / "huge.txt"
    small.write_bytes(b"a" * (CONTEXT * PROMPT_BYTES_PER_TOKEN + 1))  # refused too
    with huge.open("wb") as f:
        f.truncate(256 << 20)  # sparse: 256 MiB of NUL bytes (valid UTF-8) on no disk
    at = ("generate", "--model", str(short_context), "--session", "s")
    at += ("--store", str(tmp_path / "st"))
    base = peak_rss_of(*at, "--prompt-file", str(small))
    assert peak_rss_of(*at, "--prompt-file", str(huge)) - base < 32 << 20


def test_kv_bits_on_a_model_with_rings_is_refused_before_anything_runs(
    tmp_path: Path, model_dir: Any
) -> None:
    """gemma3's sliding-window layers are RotatingKVCache, which mlx-lm cannot
    quantize: generate failed with exit 3 ("a bug in persist") once the prompt
    reached --quantized-kv-start, and persist serve answered 500 to every such
    request.  Both refuse the options at once, naming the ring."""
    m = model_dir("gemma3")
    res = run(
        "generate", "--model", str(m), "--store", str(tmp_path / "s"), "--session", "g",
        "--prompt", "hello world this is a test", "-m", "2",
        "--kv-bits", "4", "--kv-group-size", "16", "--quantized-kv-start", "2", code=1,
    )  # fmt: skip
    assert "cannot quantize rings" in res.output and "layer 0 is a ring" in res.output
    env = {**os.environ, "PYTHONPATH": pythonpath(), "PERSIST_HOME": str(tmp_path / "h")}
    served = subprocess.run(
        [sys.executable, "-m", "persist", "serve", "--model", str(m), "--port", "0",
         "--kv-bits", "4", "--quantized-kv-start", "4"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert served.returncode == 1, served.stderr
    assert "cannot quantize rings" in served.stderr
