"""`studiotui serve`: the API verb, kept apart so that building the parser stays cheap."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studiotui.api.defaults import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT
from studiotui.cli.argtypes import listen_port
from studiotui.core.errors import UserError

if TYPE_CHECKING:  # the dashboard and the controller load only when they run
    from studiotui.app.app import ServiceStarter
    from studiotui.cluster.controller import Controller


def listen_refused(host: str, port: int, exc: OSError) -> UserError:
    """What to say when the server cannot bind: the cause and what to change (aiohttp's
    own text names neither the option nor a way out)."""
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return UserError(
            f"{where}: port {port} is in use (another studiotui, or another program)",
            "pick another --port (0 takes any free one)",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return UserError(
            f"{where}: {host} is not an address of this machine",
            "give --host one of its addresses (0.0.0.0: all of them)",
        )
    return UserError(f"{where}: {exc.strerror}", "check --host and --port")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve the placements over HTTP: the OpenAI (Chat, Responses), Anthropic "
        "Messages and Ollama APIs",
    )
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})"
    )
    p.add_argument("--port", type=listen_port, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
        "the environment keeps the key out of `ps`)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="require one of the keys in FILE, one 'NAME KEY' a line; each request is "
        "logged with its key's name, and the file is read again when it changes (edit it "
        "to add or revoke a key, no restart)",
    )
    return p


def key_file_of(args: argparse.Namespace) -> Path | None:
    """--api-key-file, checked before anything starts: a file that cannot be used is
    the operator's mistake, said with the line to fix."""
    path: Path | None = getattr(args, "api_key_file", None)
    if path is None:
        return None
    from studiotui.api.keys import KeyFileError, Keys

    try:
        Keys(path=path)
    except KeyFileError as exc:
        raise UserError(
            str(exc), "write one key a line as 'NAME KEY' (# starts a comment)"
        ) from None
    return path


def cmd_serve(args: argparse.Namespace, home: Path) -> int:
    # Ctrl-C is how serve is meant to end, not an error.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_main(args, home))
    print("studiotui serve: stopped")
    return 0


async def _serve_main(args: argparse.Namespace, home: Path) -> None:
    # Imported here: aiohttp is only worth loading when the server runs.
    from studiotui.api.server import MODELS, is_loopback, start_server
    from studiotui.cli.args import inventory_of
    from studiotui.cluster import running
    from studiotui.cluster.session import open_controller

    key_file = key_file_of(args)
    inv = inventory_of(args, home)
    async with open_controller(inv, home, telemetry=True) as ctl:
        try:
            server = await start_server(ctl, args.host, args.port, args.api_key, key_file)
        except OSError as exc:
            raise listen_refused(args.host, args.port, exc) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        ready = ", ".join(p.name for p in server.app[MODELS].ready()) or "none ready yet"
        print(f"studiotui serve: {server.url} (models: {ready}); Ctrl-C stops")
        if key_file:
            print(f"studiotui serve: API keys from {key_file} (read again when it changes)")
        if not args.api_key and not key_file and not is_loopback(args.host):
            print(f"warning: {args.host} without --api-key: anyone on the network can use it")
        # Listed by `studiotui status`, stopped by `studiotui down --all`.
        pid_file = running.register(home, "api", server.url)
        try:
            await until_stopped(server)
        finally:
            running.unregister(pid_file)


async def until_stopped(server: Any) -> None:
    """Serve until Ctrl-C or SIGTERM (systemd, launchd, kill: as clean as Ctrl-C), then
    close `server` (anything with an async `close()`)."""
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        pass
    finally:
        await server.close()


def api_service(
    host: str, port: int, api_key: str | None, key_file: Path | None = None
) -> ServiceStarter:
    """The API served from the dashboard's own process (`studiotui --serve PORT`)."""

    async def start(ctl: Controller) -> Any:
        from studiotui.api.server import start_server

        server = await start_server(ctl, host, port, api_key, key_file)
        ctl.record(f"serving the HTTP API (OpenAI, Anthropic, Ollama) on {server.url}")
        return server

    return start
