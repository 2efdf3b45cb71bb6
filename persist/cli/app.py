"""The click group, shared options, and the one place errors become exit codes.

Exit codes: 0 success, 1 a PersistError (one clear line on stderr), 2 usage,
3 a bug (with its traceback), 130 interrupted.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..errors import IdentityMismatchError, InvalidArgumentError, PersistError

__all__ = [
    "cli",
    "emit",
    "human_bytes",
    "store_option",
    "json_option",
    "open_store",
    "parse_size",
    "plain",
    "progress",
]

F = TypeVar("F", bound=Callable[..., Any])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# C0 and C1 controls, DEL, and the bidirectional overrides: a name that carries them
# could move the cursor, rewrite an operator's line (CR, CSI, OSC) or reorder it.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def plain(text: object) -> str:
    """``text`` safe for a terminal: every control character escaped (``\\x1b``, ``\\u202e``).

    Every human-readable line that shows a name, a path or a message goes through
    it; JSON output carries the exact strings (JSON escapes controls itself)."""
    return _CONTROL.sub(_escape, str(text))


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def parse_size(text: str) -> int:
    """'500M', '2GiB', '1.5g', '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size like 500M or 2G")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def emit(as_json: bool, data: Any, render: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON for scripts, or through ``render`` for people."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        render(data)


def default_store() -> Path:
    home = os.environ.get("PERSIST_HOME")
    if home:
        return Path(home)  # Store expands ~ and $VARS
    from platformdirs import user_cache_dir

    # persist's own cache folder (the demo model lives beside the store)
    return Path(user_cache_dir("persist")) / "store"


TIER_OPTIONS = {  # option -> (environment variable, help)
    "shared": ("PERSIST_SHARED", "A shared tier every machine reads, redis://host:port/db."),
    "cold": ("PERSIST_COLD", "A durable cold tier for named sessions, s3://bucket/prefix."),
}


def store_option(f: F) -> F:
    for name, (env, text) in TIER_OPTIONS.items():
        f = click.option(
            f"--{name}",
            envvar=env,
            default=None,
            expose_value=False,  # read by open_store and serve through tier_urls()
            callback=_remember_tier,
            help=f"{text} (${env})",
        )(f)
    f = click.option(
        "--tier-key-file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        expose_value=False,
        callback=_remember_tier,
        help="A file with the operator key (hex) that authenticates the tiers "
        "(else $PERSIST_TIER_KEY).",
    )(f)
    return click.option(
        "--store",
        "store_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Store directory (default: $PERSIST_HOME, else the user cache dir).",
    )(f)


def _remember_tier(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    ctx.meta[f"persist.{param.name}"] = value


def tier_urls() -> dict[str, Any]:
    """The tier URLs of the command running (--shared, --cold, or their variables) and
    the operator key of --tier-key-file (None: the Store reads $PERSIST_TIER_KEY)."""
    ctx = click.get_current_context(silent=True)
    meta = {} if ctx is None else ctx.meta
    out: dict[str, Any] = {name: meta.get(f"persist.{name}") for name in TIER_OPTIONS}
    path = meta.get("persist.tier_key_file")
    out["tier_key"] = None if path is None else read_tier_key(path)
    return out


def read_tier_key(path: Path) -> bytes:
    from ..engine.tier_records import parse_key

    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read the tier key file {path}: {e}") from None
    return parse_key(text, f"the tier key file {path}")


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)


def open_store(store_dir: Path | None, **kw: Any) -> Any:
    from ..engine.store import Store

    kw = {**tier_urls(), **kw}
    return Store(store_dir if store_dir is not None else default_store(), **kw)


class _Bar:
    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if not sys.stderr.isatty() or total <= 0:
                return
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def progress(label: str) -> _Bar:
    """A progress callback (done, total) that draws a bar on an interactive stderr."""
    return _Bar(label)


REPORT = "persist: this is a bug in persist; please report it with the traceback above"


class PersistGroup(click.Group):
    """Exit codes: 0 done, 1 a PersistError (the library turns what the system
    refuses into ``StorageError``), 2 a usage error (click), 3 anything else:
    a bug (traceback and a line asking to report it), 130 Ctrl-C.  A closed
    pipe (``persist ls | head``) ends quietly."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            _escape_click(e)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PersistError as e:
            hint = "; pass --model with the model it was saved for"
            extra = hint if isinstance(e, IdentityMismatchError) else ""
            click.echo(f"persist: error: {plain(e)}{extra}", err=True)
            sys.exit(1)
        except BrokenPipeError:
            _quiet_stdout()
            sys.exit(0)
        except KeyboardInterrupt:
            click.echo("persist: interrupted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            _escape_click(e)  # click quotes some values raw ("extra argument (x)")
            raise
        except (click.exceptions.Exit, click.Abort):
            raise
        except Exception:
            import traceback

            traceback.print_exc()
            click.echo(REPORT, err=True)
            sys.exit(3)


def _escape_click(e: click.ClickException) -> None:
    vars(e)["message"] = plain(e.message)  # typed Final in click, a plain attribute at run time


def _quiet_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


@click.group(cls=PersistGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx-persist", prog_name="persist")
def cli() -> None:
    """Save MLX inference caches, resume them bit-exactly, reuse prefixes.

    \b
    Example:
      persist generate --session work --prompt "Summarize our plan."
      persist ls
    """
