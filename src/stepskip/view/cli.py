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


def _source(path: str, tokenizer: str | None, allow_pickle: bool, options: list[str] | None, **more: Any) -> Any:
    from stepskip.cli.app import storage_options
    from stepskip.view.data import ViewSource

    tok = None
    if tokenizer:
        from stepskip.cli.content import load_tokenizer

        tok = load_tokenizer(tokenizer)
    return ViewSource(path, storage_options(options), allow_pickle=allow_pickle, tokenizer=tok, **more)


def view_command(
    dump_dir: Annotated[str, typer.Argument(metavar="DUMP_DIR", help="The cache: a dump_dir, an experiment or run "
                                            "directory; a local path or a URL (memory://, s3://).")]
    = "~/.verl/rollout_dump",
    tokenizer: Tokenizer = None,
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="The port (0: any free one).")] = 8765,
    host: Annotated[str, typer.Option("--host", help="The address to listen on. 127.0.0.1 (the default) keeps the "
                                      "page to this machine; any other address (0.0.0.0, a LAN address) makes every "
                                      "request carry a per-launch token, printed in the URL.")] = "127.0.0.1",
    token: Annotated[Optional[str], typer.Option("--token", show_default=False, help="The token the page asks for "
                                                 "(16+ letters, digits, '-', '_', '.', '~') instead of a random one; "
                                                 "with a loopback --host it is asked for there too.")] = None,
    allow_pickle: AllowPickle = False,
    options: StorageOptions = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Watch a run being recorded: new steps appear in "
                                         "the open page without a reload.")] = False,
    live_seconds: Annotated[float, typer.Option("--live-seconds", min=1, help="The run list marks a run as being "
                                                "written when it recorded a step (or began writing one) this "
                                                "recently.")] = 600.0,
) -> None:
    """Look at a cache in the browser: runs, steps, trajectories, rewards, lengths, two steps side by side.

    Read-only: the page never writes to the cache, and only GET requests are answered. Ctrl-C stops it.

    With --follow the page asks every 2 seconds whether the cache changed (a few directory listings
    per run) and shows the steps a live run records as they land; the run list marks the runs written
    to within --live-seconds.

    Only this page can read the cache: a request is answered only when the browser addressed it to the
    bound address, localhost or a loopback address (another web site that points its own name at this
    machine gets 421), and never when another web site's page sent it (403). Every answer tells the
    browser not to frame it or share it with other sites.

    Listening on an address other machines reach (--host 0.0.0.0 or a LAN address) needs a token, new at
    each launch: the printed URL carries it (http://host:port/?token=...); opened once, the browser keeps
    it in a cookie for this page. Scripts may send it as "Authorization: Bearer <token>". There is no way
    to turn the token off for such an address.

    [bold]Examples[/]
      stepskip view ~/.verl/rollout_dump --tokenizer /models/Qwen2.5-7B-Instruct
      stepskip view s3://bucket/rollout_dump --storage-option anon=true --port 9000
      stepskip view ~/.verl/rollout_dump --host 0.0.0.0   # prints http://127.0.0.1:8765/?token=...
      stepskip view /data/rollout_dump --follow           # while a run records into it
    """
    from stepskip.errors import SkipConfigError
    from stepskip.view.server import make_server

    source = _source(dump_dir, tokenizer, allow_pickle, options, follow=follow, live_seconds=live_seconds)
    try:
        server = make_server(source, host, port, token)
    except SkipConfigError as err:
        raise CliError(f"--token: {err}") from None
    except OSError as err:
        raise CliError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port") from None
    first, *others = server.urls()
    render.out.print(f"stepskip view: serving {source.index.given} at {first} (Ctrl-C stops)", soft_wrap=True)
    for url in others:
        render.out.print(f"  or from another machine: {url}", soft_wrap=True)
    if not server.loopback:
        render.err.print(f"[yellow]note:[/] listening on {host}: other machines can connect, so every request must "
                         "carry the token in the URL above (opened once, the browser keeps it in a cookie)",
                         soft_wrap=True)
    elif server.token is not None:
        render.err.print("note: every request must carry the token in the URL above (opened once, the browser "
                         "keeps it in a cookie)", soft_wrap=True)
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
