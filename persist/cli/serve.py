"""``persist serve``: mlx-lm's server with this store behind its prompt cache."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from ..errors import PersistError
from .app import cli, default_store, open_store, parse_size, plain, store_option, tier_urls


@cli.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--model",
    "model_dir",
    default=None,
    metavar="PATH_OR_REPO",
    help="The model's folder or a Hugging Face repo id (default: the built-in demo model).",
)
@click.option(
    "--max-bytes", default=None, help="Store budget, e.g. 20G (default: the store's budget)."
)
@click.option("--namespace", default="default", show_default=True)
@click.option(
    "--backlog",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="Connections the listening socket holds while all are busy (mlx-lm's is 5).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    help="Seconds SIGTERM waits for accepted requests before stopping generation.",
)
@click.option(
    "--write-queue",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="Caches waiting to be written behind to the store.",
)
@click.option(
    "--when-full",
    type=click.Choice(["block", "drop"]),
    default="block",
    show_default=True,
    help="A full write queue: wait (up to 30 s) for room, or drop the write and count it.",
)
@click.option(
    "--mlx-cache",
    default="auto",
    show_default=True,
    help="Freed MLX buffers kept for reuse on the CPU backend, e.g. 8G; 'auto': up to "
    "MLX's memory limit, as on GPUs (MLX's CPU default of 32 MiB makes every restore "
    "fault in fresh memory).",
)
@click.option(
    "--max-request-bytes",
    default="4M",
    show_default=True,
    help="Largest request body taken (larger: 413), e.g. 16M.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a client has to send its whole request (slower: 408, connection closed).",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="Connections open at once (at most half the open-file limit); past it, the client "
    "sending its request longest is closed (503), or the new one if all are being served.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object a line, for log shippers.",
)
@click.option(
    "--host-cache",
    default="auto",
    show_default=True,
    help="RAM for caches mlx-lm's prompt cache evicts, asked before the store, e.g. 4G; "
    "'auto': min(10% of available memory, 8G); 0: none.  On CUDA they are kept in "
    "pinned host memory and restored over PCIe ('auto' there: none if pinning fails).",
)
@click.option(
    "--max-tokens-limit",
    type=click.IntRange(1),
    default=32768,
    show_default=True,
    help="Most tokens one request may ask for (max_tokens above it: 400); every answer "
    "is also cut to what the model's context leaves after the prompt.",
)
@click.option(
    "--allowed-models",
    default="",
    metavar="NAMES",
    help="Comma-separated further models (folders or repo ids) a request's model field may "
    "name; by default only the served model, under its names.",
)
@click.option(
    "--api-keys",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Tenants by API key: a file of 'KEY TENANT' lines (or JSON {KEY: TENANT}); a "
    "request needs 'Authorization: Bearer KEY' (else 401), and each tenant's caches are "
    "its own in every tier.  See docs/tenants.md.",
)
@click.option(
    "--tenant-header",
    default=None,
    metavar="NAME",
    help="Tenants by this request header, set by a trusted gateway (without --api-keys).",
)
@click.option(
    "--public-prefix",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="System prompts (and tools) every tenant may share: a JSON list of "
    '{"messages": [system messages], "tools": [...]}, or one system prompt\'s text.',
)
@click.option(
    "--allow-public-marks",
    is_flag=True,
    default=False,
    help='Let a request mark its system prompt public ("persist": {"public_system": true}): '
    "its system block goes to the namespace every tenant reads (without it: 400).  Any "
    "tenant can then write there; see docs/tenants.md.",
)
@click.option(
    "--tenant-max-bytes",
    default=None,
    metavar="SIZE",
    help="Budget of each tenant (namespace) in the store and the host cache, e.g. 2G: "
    "one tenant cannot evict the others.",
)
@click.option(
    "--warm",
    type=click.IntRange(0, 100_000),
    default=0,
    show_default=True,
    help="Read the N most valuable stored entries of each loaded model (pinned, then "
    "most recently used) into the host cache before serving, so conversations "
    "returning after a restart are answered from RAM.",
)
@store_option
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(
    model_dir: str | None,
    max_bytes: str | None,
    namespace: str,
    backlog: int,
    drain_timeout: float,
    write_queue: int,
    when_full: str,
    mlx_cache: str,
    max_request_bytes: str,
    request_timeout: float,
    log_format: str,
    max_connections: int,
    host_cache: str,
    max_tokens_limit: int,
    allowed_models: str,
    api_keys: str | None,
    tenant_header: str | None,
    public_prefix: str | None,
    allow_public_marks: bool,
    tenant_max_bytes: str | None,
    warm: int,
    store_dir: Path | None,
    server_args: tuple[str, ...],
) -> None:
    """Run mlx-lm's server with a durable prompt cache that survives restarts.

    Any further options go to mlx_lm.server (--host, --port, --prompt-cache-size, ...).
    SIGTERM or Ctrl-C stops in order: no new connections, accepted requests
    finish, the write-behind queue is flushed; a second signal stops at once.
    If generation stops for good, the same stop runs and the exit status is 1.
    GET /health (JSON) and GET /metrics (Prometheus) are for operators.

    \b
    Example:
      persist serve --model ./tiny --store ./cache --port 8080
      persist serve --model ./tiny --mlx-cache 8G --port 8080
      persist serve --model ./tiny --warm 50 --port 8080
    """
    with _stopping(log_format), _exit_line(log_format):  # before the imports (MLX's)
        from ..apps.hub import resolve_model
        from ..serve.app import serve
        from ..serve.tenants import tenants_from

        root = store_dir if store_dir is not None else default_store()
        if max_bytes:
            budget = parse_size(max_bytes)
        else:  # the store's remembered budget, else the default one (persist config)
            with open_store(root, create=True) as store:
                budget = store.budgets.max_bytes
        serve(
            str(resolve_model(model_dir)),
            root,
            max_bytes=budget,
            namespace=namespace,
            server_args=list(server_args),
            backlog=backlog,
            drain_timeout=drain_timeout,
            queue_size=write_queue,
            when_full=when_full,
            mlx_cache=None if mlx_cache == "auto" else parse_size(mlx_cache),
            read_timeout=request_timeout,
            max_request_bytes=parse_size(max_request_bytes),
            log_format=log_format,
            max_connections=max_connections,
            host_cache=None if host_cache == "auto" else parse_size(host_cache),
            max_tokens_limit=max_tokens_limit,
            allowed_models=[m.strip() for m in allowed_models.split(",") if m.strip()],
            model_names=[model_dir] if model_dir else [],
            tenants=tenants_from(
                namespace, api_keys, tenant_header, public_prefix, allow_public_marks
            ),
            tenant_max_bytes=parse_size(tenant_max_bytes) if tenant_max_bytes else None,
            warm=warm,
            **tier_urls(),
        )


@contextlib.contextmanager
def _stopping(log_format: str) -> Iterator[None]:
    """A SIGTERM while the server starts is an orderly stop, exit 0 (``serve.early_stop``);
    once the command is done (or interrupted), a signal no longer kills the exiting process."""
    from ..serve.early_stop import StoppedAtStart, early_stop, exiting

    early_stop()  # SIGTERM noted from here, before the imports and the model load
    try:
        yield
    except StoppedAtStart as e:
        exiting()
        from ..serve.logs import use_log_format

        use_log_format(log_format)
        if not logging.getLogger().handlers:  # mlx-lm had not configured logging yet
            logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s")
        logging.getLogger("persist").warning(
            "persist serve: stopped (%s) before it served: exit 0", e.args[0] if e.args else e
        )
        return
    except KeyboardInterrupt:  # Ctrl-C while it started: "interrupted", 130, and no
        exiting()  # second Ctrl-C may end the process by the signal as it exits
        raise
    exiting()


@contextlib.contextmanager
def _exit_line(log_format: str) -> Iterator[None]:
    """With --log-format json, why the process exits is one JSON log line like every
    other (exit 1, or 3 for a bug); with text, persist's own error line."""
    try:
        yield
    except click.ClickException:
        raise  # a usage error: click's message and exit 2
    except Exception as e:
        if log_format != "json":
            raise
        from ..serve.logs import use_log_format

        use_log_format("json")  # also when it failed before mlx-lm configured logging
        log = logging.getLogger("persist")
        if isinstance(e, PersistError):
            log.error("persist: error: %s", plain(e))
            sys.exit(1)
        log.error("persist: this is a bug in persist; please report it", exc_info=e)
        sys.exit(3)
