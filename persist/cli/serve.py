"""``persist serve``: mlx-lm's server with this store behind its prompt cache."""

from __future__ import annotations

from pathlib import Path

import click

from .app import cli, default_store, parse_size, store_option


@cli.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="mlx-lm model directory (default: the built-in demo model).",
)
@click.option("--max-bytes", default=None, help="Store budget, e.g. 20G.")
@click.option("--namespace", default="default", show_default=True)
@store_option
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(
    model_dir: Path | None,
    max_bytes: str | None,
    namespace: str,
    store_dir: Path | None,
    server_args: tuple[str, ...],
) -> None:
    """Run mlx-lm's server with a durable prompt cache that survives restarts.

    Any further options go to mlx_lm.server (--host, --port, --prompt-cache-size, ...).

    \b
    Example:
      persist serve --model ./tiny --store ./cache --port 8080
    """
    from ..demo import demo_model_dir
    from ..serving import serve

    serve(
        str(model_dir if model_dir is not None else demo_model_dir()),
        store_dir if store_dir is not None else default_store(),
        max_bytes=parse_size(max_bytes) if max_bytes else None,
        namespace=namespace,
        server_args=list(server_args),
    )
