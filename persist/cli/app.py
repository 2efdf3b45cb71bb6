"""The click group, shared options, and the one place errors become exit codes.

Exit codes: 0 success, 1 a PersistError (one clear line on stderr), 2 usage,
3 a bug (with its traceback), 130 interrupted.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import click

from ..errors import (
    IdentityMismatchError,
    InvalidArgumentError,
    PersistError,
    StorageError,
    StoreNotFoundError,
)
from .terminal import end_line, progress

__all__ = [
    "cli",
    "emit",
    "human_bytes",
    "store_option",
    "json_option",
    "open_store",
    "open_index",
    "parse_size",
    "plural",
    "plain",
    "progress",
]

F = TypeVar("F", bound=Callable[..., Any])
MAX_SIZE = (1 << 63) - 1  # what SQLite's integers and the budgets hold


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plural(n: int, one: str, many: str | None = None) -> str:
    """'1 session', '2 sessions', '1 entry' / '3 entries'."""
    return f"{n} {one if n == 1 else many or one + 's'}"


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
    """'500M', '2GiB', '1.5g', '1000', '2P', '7E' -> bytes; a usage error (exit 2) for
    what is no size, InvalidArgumentError (exit 1) for a size past MAX_SIZE."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtpe]?)(i?b)?\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size like 500M or 2G")
    # exact decimal arithmetic: a float of 400 digits is inf, and int(inf) raised
    size = int(Decimal(m.group(1)) * 1024 ** " kmgtpe".index(m.group(2) or " "))
    if size > MAX_SIZE:
        raise InvalidArgumentError(
            f"{text[:40]!r} is larger than persist takes: at most {MAX_SIZE:,} bytes "
            "(8E less one byte)"
        )
    return size


def emit(as_json: bool, data: Any, render: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON for scripts, or through ``render`` for people."""
    if as_json:
        import json  # imported for --json only: a plain `persist ls` starts without it

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
    from ..engine.tiers.records import parse_key
    from ..serve.option_files import read_option_file

    # a regular file, bounded: /dev/zero or a FIFO is refused, never read whole or waited on
    data = read_option_file(path, KEY_FILE_BYTES, "tier key")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"cannot read the tier key file {path}: {e}") from None
    return parse_key(text, f"the tier key file {path}")


KEY_FILE_BYTES = 4096


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)


def open_store(store_dir: Path | None, *, create: bool = False, **kw: Any) -> Any:
    """The store of ``--store`` (or the default one).  Only commands that write
    sessions (``create``) make a store; the others refuse a folder without one, so
    a mistyped ``--store`` is an error, not a new empty store."""
    from ..engine.store import Store
    from ..storage.rows import store_root

    root = store_root(store_dir if store_dir is not None else default_store())
    if not create and not (root / "index.sqlite").is_file():
        raise StoreNotFoundError(root)
    kw = {**tier_urls(), **kw}
    store = Store(root, **kw)
    if create and "max_bytes" not in kw:  # what writes is held to the store's budget
        from ..storage import housekeeping
        from ..storage.retention import Budgets

        limit, _ = housekeeping.budget(store.index, store.root)
        store.budgets = Budgets(limit, store.budgets.per_namespace)
    return store


@contextlib.contextmanager
def open_index(store_dir: Path | None) -> Iterator[Any]:
    """The index of ``--store`` alone, for the commands that only read rows (ls, show):
    no ``Store``, so a listing imports neither the engine (costs, retention, tiers) nor
    the blob files and their format; its first rows come after SQLite's open.  A folder
    without a store is refused, as ``open_store`` refuses it."""
    from ..storage import access, full
    from ..storage.index import Index
    from ..storage.rows import store_root
    from ..storage.schema import connect

    root = store_root(store_dir if store_dir is not None else default_store())
    path = root / "index.sqlite"
    if not path.is_file():
        raise StoreNotFoundError(root)
    try:  # block size 256 is only a default: adopt keeps the store's own
        access.check_owner(root)  # as Store(): another user's store is refused
        read_only = access.read_only(root)
        if read_only:
            db = access.connect_read_only(path)
        else:
            db = full.with_room(root, lambda: connect(path, 256, adopt=True))
    except PersistError:
        raise
    except OSError as e:  # as Store(): permissions, a file where a folder goes
        raise StorageError(f"cannot open the store at {root}", e) from e
    try:
        yield Index(db, root if read_only else None)
    finally:
        db.conn.close()


def complete_sessions(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[click.shell_completion.CompletionItem]:
    """Shell completion of session names, from the store the command line names so far.
    Completion never makes a store and never fails: a problem completes nothing."""
    from click.shell_completion import CompletionItem

    try:
        from ..storage.listing import stream

        given = ctx.params.get("store_dir")
        with open_index(given) as index:  # the names that start so: a range of an index
            rows = stream(index, ctx.params.get("namespace"), prefix=incomplete)
            names = [r.name for r in rows]
    except Exception:  # a half-typed command line, no store: offer nothing, no traceback
        return []
    return [CompletionItem(n) for n in sorted({n for n in names if n})]


REPORT = "persist: this is a bug in persist; please report it with the traceback above"


# command -> the module of persist.cli that registers it (imported when it runs)
COMMANDS = {
    **dict.fromkeys(["ls", "show", "check", "pin", "unpin"], "sessions"),
    "rm": "removal",
    **dict.fromkeys(["gc", "stats", "config"], "maintenance"),
    **dict.fromkeys(["generate", "prime"], "run"),
    **dict.fromkeys(["export", "import", "sync"], "transfer"),
    **dict.fromkeys(["inspect", "verify"], "files"),
    "serve": "serve",
    "make-model": "models",
    "explain": "explain",
}


def load_commands(name: str | None = None) -> None:
    """Import the module of command ``name``; of every command when None (or unknown)."""
    import importlib

    mod = COMMANDS.get(name or "")
    for m in [mod] if mod else sorted(set(COMMANDS.values())):
        importlib.import_module(f"{__package__}.{m}")


class PersistGroup(click.Group):
    """Exit codes: 0 done, 1 a PersistError (the library turns what the system
    refuses into ``StorageError``), 2 a usage error (click), 3 anything else:
    a bug (traceback and a line asking to report it), 130 Ctrl-C.  A closed
    pipe (``persist ls | head``) ends quietly."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            load_commands(cmd_name)
        if cmd_name not in self.commands:  # a command COMMANDS does not name yet
            load_commands()
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        load_commands()
        return super().list_commands(ctx)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            _escape_click(e)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        from .interrupts import finishing, forget_committed, interrupted_line

        as_json = "--json" in ctx.args  # the command's own flag, not parsed yet
        forget_committed()
        try:
            out = super().invoke(ctx)
            finishing(0)  # done: a Ctrl-C from here on says so and exits 130
            return out
        except (SystemExit, click.exceptions.Exit) as e:  # the command's own exit status
            code = e.exit_code if isinstance(e, click.exceptions.Exit) else e.code
            finishing(code if isinstance(code, int) else 1)
            raise
        except PersistError as e:
            end_line()  # an answer cut short keeps its line
            extra = _mismatch_hint(e) if isinstance(e, IdentityMismatchError) else ""
            _fail(as_json, f"{e}{extra}", type(e).__name__, 1)
        except BrokenPipeError:
            _quiet_stdout()
            sys.exit(0)
        except KeyboardInterrupt:
            end_line()  # never glued to the answer's line or a bar
            _fail(as_json, interrupted_line(), "KeyboardInterrupt", 130)
        except click.ClickException as e:
            if not as_json:
                _escape_click(e)  # click quotes some values raw ("extra argument (x)")
                raise
            _fail(as_json, e.format_message(), type(e).__name__, e.exit_code)
        except click.Abort:
            raise
        except Exception as e:
            import traceback

            traceback.print_exc()
            _fail(as_json, f"{type(e).__name__}: {e}", "Bug", 3, REPORT)


def _fail(as_json: bool, message: str, kind: str, code: int, text: str | None = None) -> None:
    """Say what failed, one line on stderr (or, under --json, a JSON object on stdout
    for the script that asked for JSON), and exit with ``code``."""
    if as_json:  # the exact message: JSON escapes controls itself
        import json

        click.echo(json.dumps({"error": message, "type": kind, "exit": code}))
    else:
        line = text or f"persist: {'error: ' if code == 1 else ''}{plain(message)}"
        click.echo(line, err=True)
    from .interrupts import finishing

    finishing(code)  # said: a Ctrl-C while exiting keeps this status
    sys.exit(code)


def _mismatch_hint(e: IdentityMismatchError) -> str:
    if e.fields and all(f.startswith("cache_config.") for f in e.fields):
        return "; pass the --kv-bits / --max-kv-size options it was saved with"
    return "; pass --model with the model it was saved for"


def _escape_click(e: click.ClickException) -> None:
    if isinstance(e, click.exceptions.NoArgsIsHelpError):
        return  # a group given no command: its message is persist's own help, lines and all
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
