"""`studiotui web`: the real verb serving the real dashboard, loaded in headless Chromium.

Two real agents on 127.0.0.121-122:58100; `python -m studiotui -i cluster.toml web
--port 0` in its own process; Chromium (driven by playwright, the system's
/usr/bin/chromium, nothing downloaded) opens the address it printed, and the nodes
are read back from a screenshot of the page with tesseract.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from aiohttp import ClientSession, WSServerHandshakeError

from studiotui.cli.main import main
from studiotui.cli.web import COOKIE, dashboard_command, host_name, start_web
from studiotui.core.inventory import dump_inventory
from tests.support.cluster_fixture import cluster_fixture
from tests.support.output import read_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Web:
    proc: subprocess.Popen[str]
    url: str  # with ?token=
    base: str
    token: str
    nodes: list[str]


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    home = tmp_path_factory.mktemp("web-home")
    for cluster in cluster_fixture(home, 2, 121, 58100):
        inventory = home / "cluster.toml"
        inventory.write_text(dump_inventory(cluster.inventory))
        env = {**os.environ, "STUDIOTUI_HOME": str(home)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "studiotui", "-i", str(inventory), "web", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            assert proc.stdout is not None
            found, _ = read_until(proc.stdout, r"(http://127\.0\.0\.1:\d+)/\?token=(\S+)")
            base, token = found.groups()
            yield Web(proc, f"{base}/?token={token}", base, token, list(cluster.inventory.names))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=20)


def test_the_token_is_asked_for_everywhere(web: Web) -> None:
    with httpx.Client(base_url=web.base, follow_redirects=False, timeout=20) as http:
        for path in ("/", "/?token=wrong", "/static/js/textual.js", "/ws", "/download/x"):
            refused = http.get(path)
            assert refused.status_code == 403, path
            assert "token printed when `studiotui web` started" in refused.text
        rebound = http.get(f"/?token={web.token}", headers={"Host": "evil.example"})
        assert rebound.status_code == 403
        # The right token once: a cookie from then on, and an address without the token.
        given = http.get(f"/?token={web.token}")
        assert given.status_code == 303 and given.headers["location"] == "/"
        cookie = given.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}={web.token}")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        http.cookies.set(COOKIE, web.token)
        page = http.get("/")
        assert page.status_code == 200 and "textual-terminal" in page.text
        assert f"ws://{host_name(web.base[len('http://') :])}" in page.text
        assert http.get("/static/js/textual.js").status_code == 200


async def test_a_websocket_from_another_page_is_refused(web: Web) -> None:
    async with ClientSession(cookies={COOKIE: web.token}) as session:
        with pytest.raises(WSServerHandshakeError) as caught:
            await session.ws_connect(f"{web.base}/ws", headers={"Origin": "http://evil.example"})
    assert caught.value.status == 403


def ocr(png: Path) -> str:
    out = subprocess.run(
        ["tesseract", str(png), "-", "--psm", "6"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_chromium_shows_the_nodes(web: Web, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists() or shutil.which("tesseract") is None:
        why = "needs /usr/bin/chromium and tesseract: apt-get install chromium tesseract-ocr"
        # .ci/run installs both: in CI a missing browser is a failure, not a skip.
        assert not os.environ.get("CI"), why
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1600, "height": 1000},
        )
        try:
            page = browser.new_page()
            frames: list[str] = []
            page.on(
                "websocket",
                lambda ws: ws.on(
                    "framereceived",
                    lambda f: frames.append(
                        f if isinstance(f, str) else f.decode(errors="replace")
                    ),
                ),
            )
            # A large font, for the screenshot to be read back reliably.
            page.goto(f"{web.url}&fontsize=26")
            # The dashboard process starts per tab; wait until it has drawn both nodes.
            deadline = time.monotonic() + 90
            while not all(n in "".join(frames) for n in web.nodes):
                assert time.monotonic() < deadline, "the dashboard never drew the nodes"
                page.wait_for_timeout(500)
            page.wait_for_timeout(1500)  # let xterm.js paint what arrived
            assert page.url == f"{web.base}/?fontsize=26", "the token stays out of the address"
            shot = tmp_path / "dashboard.png"
            # The nodes pane: the upper left of the screen.
            page.screenshot(path=str(shot), clip={"x": 0, "y": 0, "width": 800, "height": 400})
            text = ocr(shot)
            for name in web.nodes:
                assert re.search(rf"{name}\s+up", text), f"{name} not on screen: {text!r}"
            pid = web.proc.pid
            dashboards = [p for p in psutil.Process(pid).children(recursive=True)]
            assert dashboards, "textual-serve started no dashboard process"

            # A wrong token gets the refusal, and no dashboard.
            browser.clear_cookies()
            wrong = browser.new_page()
            wrong.goto(f"{web.base}/?token=nope")
            assert "needs the token" in wrong.content()
            wrong.close()
            page.close()
        finally:
            browser.close()
    # A closed tab ends its dashboard.
    deadline = time.monotonic() + 20
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in dashboards):
        assert time.monotonic() < deadline, "the dashboard outlived its tab"
        time.sleep(0.25)


async def test_open_to_the_network_the_page_points_where_the_browser_came_from() -> None:
    server = await start_web("true", "0.0.0.0", 0)
    host = {"Host": f"studio-1.local:{server.port}"}
    try:
        assert server.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            refused = await http.get("/", headers=host)
            http.cookies.set(COOKIE, server.token)
            # Not a loopback bind: any name the machine is reached by is fine.
            page = await http.get("/", headers=host)
    finally:
        await server.close()
    assert refused.status_code == 403
    assert page.status_code == 200
    assert f"ws://studio-1.local:{server.port}/ws" in page.text
    assert f"http://studio-1.local:{server.port}/static/" in page.text


def test_the_dashboard_command_is_this_studiotui_with_the_cluster_file() -> None:
    assert dashboard_command(None, "/py") == "/py -m studiotui"
    assert dashboard_command(Path("/a b/c.toml"), "/py") == "/py -m studiotui -i '/a b/c.toml'"


def test_a_port_in_use_is_refused_saying_what_to_change(
    web: Web, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STUDIOTUI_HOME", str(tmp_path))
    port = web.base.rsplit(":", 1)[1]
    assert main(["web", "--port", port]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is in use (another studiotui" in said, (
        said
    )
    assert "pick another --port (0 takes any free one)" in said, said
