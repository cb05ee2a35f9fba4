"""The ``stepskip view`` and ``stepskip report`` commands (registered in :mod:`stepskip.cli.app`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from stepskip.cli import render
from stepskip.cli.errors import CliError

__all__ = ["report_command", "view_command"]

Tokenizer = Annotated[Optional[str], typer.Option("--tokenizer", "-t", help="A local Hugging Face tokenizer (or "
                                                  "model) directory, loaded offline: text instead of token ids.")]
AllowPickle = Annotated[bool, typer.Option("--allow-pickle", help="Read pickle-based entries (verl's gen_batch.dp, "
                                           "tq_batch.pt) through the allow-list unpickler.")]
StorageOptions = Annotated[Optional[list[str]], typer.Option(
    "--storage-option", metavar="KEY=VALUE", show_default=False,
    help="An fsspec option for URL caches, repeatable (anon=true, client_kwargs.endpoint_url=http://host:9000).")]


def _source(path: str, tokenizer: str | None, allow_pickle: bool, options: list[str] | None) -> Any:
    from stepskip.cli.app import storage_options
    from stepskip.view.data import ViewSource

    tok = None
    if tokenizer:
        from stepskip.cli.content import load_tokenizer

        tok = load_tokenizer(tokenizer)
    return ViewSource(path, storage_options(options), allow_pickle=allow_pickle, tokenizer=tok)


def view_command(
    dump_dir: Annotated[str, typer.Argument(metavar="DUMP_DIR", help="The cache: a dump_dir, an experiment or run "
                                            "directory; a local path or a URL (memory://, s3://).")]
    = "~/.verl/rollout_dump",
    tokenizer: Tokenizer = None,
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="The port (0: any free one).")] = 8765,
    host: Annotated[str, typer.Option("--host", help="The address to listen on; 127.0.0.1 keeps the page to this "
                                      "machine.")] = "127.0.0.1",
    allow_pickle: AllowPickle = False,
    options: StorageOptions = None,
) -> None:
    """Look at a cache in the browser: runs, steps, trajectories, rewards, lengths, two steps side by side.

    Read-only: the page never writes to the cache. Ctrl-C stops it.

    [bold]Examples[/]
      stepskip view ~/.verl/rollout_dump --tokenizer /models/Qwen2.5-7B-Instruct
      stepskip view s3://bucket/rollout_dump --storage-option anon=true --port 9000
    """
    from stepskip.view.server import make_server

    source = _source(dump_dir, tokenizer, allow_pickle, options)
    try:
        server = make_server(source, host, port)
    except OSError as err:
        raise CliError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port") from None
    shown = f"[{host}]" if ":" in host else host
    render.out.print(f"stepskip view: serving {source.index.given} at http://{shown}:{server.server_address[1]}/ "
                     "(Ctrl-C stops)", soft_wrap=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        render.err.print(f"[yellow]warning:[/] listening on {host}: anyone who can reach it can read this cache")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        render.out.print("stopped")
    finally:
        server.server_close()


def report_command(
    run_dir: Annotated[str, typer.Argument(metavar="RUN_DIR", help="A run directory (or a dump_dir, an experiment "
                                           "directory); a local path or a URL.")],
    output: Annotated[str, typer.Option("--output", "-o", help="The HTML file to write.")] = "report.html",
    tokenizer: Tokenizer = None,
    max_rows: Annotated[int, typer.Option("--max-rows", min=1, help="Trajectories kept per step (distributions "
                                          "and trends use all).")] = 1000,
    allow_pickle: AllowPickle = False,
    options: StorageOptions = None,
) -> None:
    """Write the views of stepskip view as one self-contained HTML file (no server, no network to open it).

    [bold]Examples[/]
      stepskip report ~/.verl/rollout_dump/exp_proj/GBS64_N8_in512_out1024 -o report.html
    """
    from stepskip.view.report import write_report

    source = _source(run_dir, tokenizer, allow_pickle, options)
    target = Path(output).expanduser().resolve()
    if not source.index.is_url and (str(target) + os.sep).startswith(source.index.root.rstrip(os.sep) + os.sep):
        raise CliError(f"--output {output} is inside the cache {run_dir}: write the report elsewhere "
                       "(stepskip never writes into a cache it reads)")
    path = write_report(source, target, max_rows)
    render.out.print(f"wrote {path} ({path.stat().st_size} bytes)", soft_wrap=True)
