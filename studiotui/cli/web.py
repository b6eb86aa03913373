"""`studiotui web`: the dashboard in a browser, served by textual-serve.

textual-serve starts one dashboard process per browser tab (the same `studiotui`
with the same cluster file) and relays its screen over a websocket to xterm.js in
the page. It has no authentication of its own, and whoever reaches it gets the
dashboard, which can place and unload models and stop nodes. So every request
passes a token check first: the token printed at start, given once as `?token=`,
then kept by the browser in an HttpOnly, SameSite=Strict cookie so that the
page's own static files and websocket carry it. It binds to localhost unless told
otherwise, and on a loopback bind refuses other Host names (DNS rebinding) and
websockets opened by other origins.

Importing this module is cheap; aiohttp and textual-serve load when it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import secrets
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studiotui.cli.argtypes import listen_port
from studiotui.cli.serve import listen_refused, until_stopped

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("studiotui.web")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 28416  # beside serve's 28415, below the ephemeral ranges
COOKIE = "studiotui_web"
REFUSED = (
    "studiotui web: this page needs the token printed when `studiotui web` started; "
    "open the whole address it printed (…/?token=…)"
)


def add_web_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("web", help="serve the dashboard in a browser (textual-serve)")
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})"
    )
    p.add_argument("--port", type=listen_port, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    return p


def dashboard_command(inventory: Path | None, python: str = sys.executable) -> str:
    """The shell command textual-serve runs for each browser tab: this dashboard."""
    argv = [python, "-m", "studiotui"]
    if inventory is not None:
        argv += ["-i", str(Path(inventory).expanduser().resolve())]
    return shlex.join(argv)


def token_ok(given: str | None, token: str) -> bool:
    # compare_digest: the time taken must not tell how much of a guess was right.
    return bool(given) and hmac.compare_digest(str(given).encode(), token.encode())


def is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


@dataclass
class WebServer:
    runner: web.AppRunner
    host: str
    port: int
    token: str
    server: Any = None  # the TokenServer: its tabs

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"  # what to type on this machine; others use its name
        return f"http://{host}:{self.port}/?token={self.token}"

    @property
    def tabs(self) -> int:
        return len(self.server.tabs) if self.server is not None else 0

    async def close(self) -> None:
        # Every tab's dashboard ended first, whatever state it is in: the runner's own
        # shutdown cancels the handlers, which may be cancelled again meanwhile.
        if self.server is not None:
            await self.server.end_tabs()
        await self.runner.cleanup()


def _guard(token: str, loopback_bind: bool) -> Callable[..., Awaitable[web.StreamResponse]]:
    from aiohttp import web

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if loopback_bind and not is_loopback(host_name(request.host)):
            return web.Response(status=403, text=f"host {request.host!r} is not this machine")
        given = request.query.get("token")
        if not (token_ok(given, token) or token_ok(request.cookies.get(COOKIE), token)):
            return web.Response(status=403, text=REFUSED)
        origin = request.headers.get("Origin")
        # A page elsewhere could open the websocket with the operator's cookie.
        if request.path == "/ws" and origin not in (None, f"{request.scheme}://{request.host}"):
            return web.Response(status=403, text=f"websocket from {origin} refused")
        if given is not None and request.path == "/":
            # Keep the token out of the address bar (and history): a cookie from now on.
            # Other parameters (textual-serve's fontsize) stay.
            rest = request.rel_url.without_query_params("token")
            resp = web.HTTPSeeOther(str(rest))
            resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
            return resp
        return await handler(request)

    return guard


# A tab's dashboard asked to quit gets this long before it is stopped by signal: one
# busy laying out its screen (mid-start, on a loaded machine) never reads the request.
QUIT_S = 3.0
TERM_S = 3.0
# Tells a tab's dashboard it is one, and whose: it ends itself if this process goes.
PARENT_VAR = "STUDIOTUI_WEB_PARENT"


def _tab_class() -> type:
    from textual_serve.app_service import AppService

    from studiotui.cluster import running

    class TabService(AppService):
        """textual-serve's app process, in a process group of its own (so the whole of
        it can be stopped), registered for `status` and `down --all`, and ended for
        certain: asked to quit, then SIGTERM, then SIGKILL (`end`)."""

        def __init__(self, *args: Any, home: Path | None = None, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.home = home
            self._pid_file: Path | None = None
            self._ended = False

        async def _open_app_process(self, width: int = 80, height: int = 24) -> Any:
            env = {**self._build_environment(width=width, height=height)}
            env[PARENT_VAR] = str(os.getpid())
            # exec, not a shell: the pid is the dashboard's, and its group is its own.
            self._process = process = await asyncio.create_subprocess_exec(
                *shlex.split(self.command),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
            self._stdin = process.stdin
            if self.home is not None:
                with contextlib.suppress(OSError):
                    self._pid_file = running.register(self.home, "tab", "", process.pid)
            return process

        async def stop(self) -> None:
            await self.end()

        async def end(self) -> None:
            """End the dashboard process whatever it is doing; once."""
            if self._ended:
                return
            self._ended = True
            process = self._process
            if process is not None and process.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.send_meta({"type": "quit"}), 1.0)
                for sig, wait in ((None, QUIT_S), (signal.SIGTERM, TERM_S), (signal.SIGKILL, 5.0)):
                    if sig is not None:
                        _signal_group(process.pid, sig)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(process.wait(), wait)
                        break
            if process is not None:
                _signal_group(process.pid, signal.SIGKILL)  # anything it left in its group
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
                self._task = None
            if self._pid_file is not None:
                running.unregister(self._pid_file)

    return TabService


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _server_class() -> type:
    from aiohttp import web
    from textual_serve.server import Server, to_int

    tab_class = _tab_class()

    class TokenServer(Server):
        """textual-serve's server behind the token check."""

        def __init__(
            self, command: str, token: str, loopback_bind: bool, home: Path | None = None
        ) -> None:
            super().__init__(command, title="studiotui")
            self.token = token
            self.loopback_bind = loopback_bind
            self.home = home
            self.tabs: set[Any] = set()

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            """textual-serve's, with a tab's dashboard ended for certain when its socket
            closes (or the handler is cancelled: the server stopping), whatever state
            the dashboard is in."""
            websocket = web.WebSocketResponse(heartbeat=15)
            width = to_int(request.query.get("width", "80"), 80)
            height = to_int(request.query.get("height", "24"), 24)
            tab = None
            try:
                await websocket.prepare(request)
                tab = tab_class(
                    self.command,
                    write_bytes=websocket.send_bytes,
                    write_str=websocket.send_str,
                    close=websocket.close,
                    download_manager=self.download_manager,
                    debug=self.debug,
                    home=self.home,
                )
                self.tabs.add(tab)
                await tab.start(width, height)
                await self._process_messages(websocket, tab)
            except asyncio.CancelledError:
                pass
            except Exception as error:
                log.exception(error)
            finally:
                if tab is not None:
                    # Shielded: a second cancel must not leave the process half ended.
                    await asyncio.shield(tab.end())
                    self.tabs.discard(tab)
                with contextlib.suppress(Exception):
                    await websocket.close()
            return websocket

        async def end_tabs(self) -> None:
            await asyncio.gather(*(t.end() for t in list(self.tabs)), return_exceptions=True)

        async def _make_app(self) -> web.Application:
            # textual-serve's own app factory: its routes, with the guard in front.
            app = await super()._make_app()
            app.middlewares.append(_guard(self.token, self.loopback_bind))
            return app

        async def on_startup(self, app: web.Application) -> None:
            pass  # textual-serve prints its logo and an address without the token

        async def handle_index(self, request: web.Request) -> web.StreamResponse:
            # The page names its websocket and files by absolute address: use the one
            # the browser reached (textual-serve would write the bind address, which
            # is 0.0.0.0 for a server open to the network).
            self.public_url = f"{request.scheme}://{request.host}"
            return await super().handle_index(request)

    return TokenServer


async def start_web(
    command: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    home: Path | None = None,
) -> WebServer:
    """Listen in the running loop; port 0 takes a free port. With `home`, each tab's
    dashboard is registered there (`running`) while it runs."""
    from aiohttp import web

    token = token or secrets.token_urlsafe(24)
    server = _server_class()(command, token, is_loopback(host), home)
    app = await server._make_app()
    # A closed tab ends its dashboard; stopping must not wait on open ones.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return WebServer(runner=runner, host=host, port=int(bound), token=token, server=server)


def cmd_web(args: argparse.Namespace, home: Path) -> int:
    # Ctrl-C is how it is meant to end, not an error.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_web_main(args, home))
    print("studiotui web: stopped")
    return 0


async def _web_main(args: argparse.Namespace, home: Path) -> None:
    from studiotui.cluster import running

    command = dashboard_command(getattr(args, "inventory", None))
    try:
        server = await start_web(command, args.host, args.port, home=home)
    except OSError as exc:
        raise listen_refused(args.host, args.port, exc) from None
    base = server.url.split("?", 1)[0]
    pid_file = running.register(home, "web", base)
    try:
        await _serve_web(server, args)
    finally:
        running.unregister(pid_file)


async def _serve_web(server: WebServer, args: argparse.Namespace) -> None:
    print(f"studiotui web: open {server.url} (Ctrl-C stops)", flush=True)
    if not is_loopback(args.host):
        print(
            f"warning: on {args.host} anyone who has the token can drive the cluster; "
            "the page is plain HTTP, so use it on a network you trust",
            flush=True,
        )
    await until_stopped(server)
