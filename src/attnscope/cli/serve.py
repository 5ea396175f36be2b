"""``attnscope serve``: start the explorer on this machine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..errors import AttnscopeError
from .command import Command
from .model_options import add_compute_arguments

if TYPE_CHECKING:
    from ..serve.guard import AllowedHosts


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", action="append", default=[], metavar="MODEL",
                        help="a model to offer: alias or local Hugging Face folder; repeat for more. The first is "
                        "loaded at start and is the page's default (default: every installed alias, minilm first)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every "
                        "address, reachable from other machines by IP address or this machine's host name)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                        help="another name the page may be opened as (e.g. a DNS name of this machine, a reverse "
                        "proxy's, or localhost:8080 for a forwarded port); repeat for more. Requests for any "
                        "other name are refused, so that a web page cannot reach the server by DNS rebinding")
    parser.add_argument("--port", type=int, default=8765, help="port (default: 8765)")
    add_compute_arguments(parser)  # --dtype and --device, of every model served
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="longest input the page and API accept, in tokens (default: 128)")


def _check_can_listen(host: str, port: int) -> None:
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        raise AttnscopeError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def _allowed_hosts(host: str, extra: list[str]) -> AllowedHosts:
    from ..serve.guard import AllowedHosts, split_host

    for name in extra:
        try:
            split_host(name)
        except ValueError:
            raise AttnscopeError(f"--allow-host takes a host name or address with an optional :PORT, "
                                 f"got {name!r}") from None
    return AllowedHosts.listening_on(host, extra)


def _run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        raise AttnscopeError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_tokens < 2:
        raise AttnscopeError("--max-tokens must be at least 2")
    hosts = _allowed_hosts(args.host, args.allow_host)
    _check_can_listen(args.host, args.port)  # before the model loads, and without uvicorn's own log line
    import uvicorn

    from ..serve.app import create_app

    print("attnscope: loading the first model...", flush=True)
    app = create_app(args.model, dtype=args.dtype, device=args.device, max_tokens=args.max_tokens, hosts=hosts)
    pool = app.state.pool
    shown = "localhost" if args.host in ("127.0.0.1", "::1", "0.0.0.0", "::") else args.host
    print(f"attnscope explorer: http://{shown}:{args.port}/  (models: {', '.join(pool.choices)}; "
          f"API schema at /docs; Ctrl+C stops)\nanswers as host {hosts.describe()}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except SystemExit as stop:  # uvicorn exits this way when it cannot bind the port
        raise AttnscopeError(f"cannot listen on {args.host}:{args.port} (in use, or not allowed)") from stop
    return 0


COMMANDS = (
    Command("serve", "start the explorer: a local web page to see, classify and intervene on attention", """examples:
  attnscope serve                            # every installed model, on http://localhost:8765/
  attnscope serve --model minilm --model ./my-bert-folder --port 9000
  attnscope serve --model smollm2 --dtype bfloat16
  attnscope serve --device cuda --dtype float16    # every model on the GPU
The page: type a sentence (and optionally a second one), pick a model, then look at the head, model
and neuron views, the pattern map (click a cell to open that head), the statistics table, and the
intervention panel (ablate or corrupt heads, skip layers, and see what changes). Its address keeps
the state, so a view can be bookmarked or shared. Scripts can call the same JSON API (/docs).""",
            _serve_arguments, _run_serve),
)
