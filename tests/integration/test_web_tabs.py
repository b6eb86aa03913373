"""`studiotui web` leaves no process behind: a tab's dashboard ends when its socket
closes (even mid-start, on a loaded machine) and when `web` stops; `status` lists the
browser view and its tabs; `down --all` stops them.

Real agents, `python -m studiotui web` in a process of its own, headless Chromium
(playwright driving the system's /usr/bin/chromium), two busy processes loading the
two cores meanwhile. What is left is read from the process tree (psutil).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from studiotui.cluster import local_cluster
from studiotui.core.inventory import dump_inventory
from tests.integration.test_web import CHROMIUM, CHROMIUM_FLAGS
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.output import read_until

BASE, PORT = 250, 57850  # 127.0.0.250-251

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("CI"),
    reason="needs /usr/bin/chromium (apt-get install chromium)",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("web-tabs-home"), 2, BASE, PORT)


@pytest.fixture
def loaded() -> Iterator[None]:
    """Both cores kept busy: a dashboard then takes seconds to start."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


@dataclass
class Web:
    proc: subprocess.Popen[str]
    url: str


def env(cluster: LocalCluster) -> dict[str, str]:
    return {**os.environ, "STUDIOTUI_HOME": str(cluster.home), "NO_COLOR": "1", "COLUMNS": "200"}


def inventory(cluster: LocalCluster) -> Path:
    path = cluster.home / "web-tabs-cluster.toml"
    path.write_text(dump_inventory(cluster.inventory))
    return path


def start_web(cluster: LocalCluster) -> Web:
    proc = subprocess.Popen(
        [sys.executable, "-m", "studiotui", "-i", str(inventory(cluster)), "web", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env(cluster),
    )
    assert proc.stdout is not None
    try:
        found, _ = read_until(proc.stdout, r"(http://127\.0\.0\.1:\d+/\?token=\S+)")
    except AssertionError:
        proc.kill()
        raise
    return Web(proc, found.group(1))


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "studiotui", "-i", str(inventory(cluster)), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(cluster),
        stdin=subprocess.DEVNULL,
    )
    print(f"$ studiotui {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def tree(pid: int) -> list[psutil.Process]:
    """The live (not zombie) processes under `pid`."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in kids if _live(p)]


def _live(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def open_tab(url: str, profile: Path, keep_s: float) -> None:
    """A browser that opens `url` and closes after `keep_s` seconds."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_timeout(keep_s * 1000)
            page.close()
        finally:
            browser.close()


def test_tabs_end_with_their_socket_and_with_web_and_leave_nothing(
    cluster: LocalCluster, tmp_path: Path, loaded: None
) -> None:
    web = start_web(cluster)
    seen: dict[int, psutil.Process] = {}
    try:
        # 1. A tab closed after 2 s, while its dashboard is still starting (loaded CPU).
        open_tab(web.url, tmp_path / "p1", 2.0)
        seen |= {p.pid: p for p in tree(web.proc.pid)}
        wait_for(lambda: not tree(web.proc.pid), 20, "the closed tab's dashboard ends")

        # 2. A tab left open: listed by status; then Ctrl-C of `web` ends it too.
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "p2"), executable_path=CHROMIUM, args=CHROMIUM_FLAGS
            )
            try:
                page = browser.new_page()
                page.goto(web.url)
                wait_for(lambda: tree(web.proc.pid), 60, "a dashboard for the open tab")
                tab = tree(web.proc.pid)[0].pid
                status = cli(cluster, "status")
                page.wait_for_timeout(1000)
                seen |= {p.pid: p for p in tree(web.proc.pid)}
                web.proc.send_signal(signal.SIGINT)
                out, _ = web.proc.communicate(timeout=30)
                assert "studiotui web: stopped" in out, out
            finally:
                browser.close()
    finally:
        if web.proc.poll() is None:
            web.proc.kill()
            web.proc.wait()
    assert seen, "no dashboard process was seen"
    left = [p for p in seen.values() if _live(p)]
    assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"
    # While the tab was open, status listed the browser view and the tab's dashboard.
    assert re.search(
        r"browser view http://127\.0\.0\.1:\d+/ \(pid " + str(web.proc.pid),
        status.stdout,
    ), status.stdout
    assert f"browser dashboard (pid {tab}," in status.stdout, status.stdout
    after = cli(cluster, "status")
    assert "browser" not in after.stdout, after.stdout

    # 3. Ctrl-C of `web` while a tab's dashboard is still starting (the browser open).
    web = start_web(cluster)
    starting: dict[int, psutil.Process] = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "p3"), executable_path=CHROMIUM, args=CHROMIUM_FLAGS
            )
            try:
                page = browser.new_page()
                page.goto(web.url)
                wait_for(lambda: tree(web.proc.pid), 30, "a dashboard starting for the tab")
                page.wait_for_timeout(1000)
                starting |= {p.pid: p for p in tree(web.proc.pid)}
                web.proc.send_signal(signal.SIGINT)
                out, _ = web.proc.communicate(timeout=30)
                assert "studiotui web: stopped" in out, out
                # Long enough for a dashboard left without its server to have started.
                page.wait_for_timeout(15_000)
            finally:
                browser.close()
    finally:
        if web.proc.poll() is None:
            web.proc.kill()
            web.proc.wait()
    left = [p for p in starting.values() if _live(p)]
    for p in left:
        p.kill()  # not left for the next test, whatever this one says
    assert not left, f"left behind mid-start: {[(p.pid, p.cmdline()) for p in left]}"
    # The agents it found running are running still; none was started or stopped.
    assert all(
        local_cluster.running_pid(n) == cluster.pids[n.name] for n in cluster.inventory.nodes
    )


def test_down_all_stops_the_api_server_and_the_browser_view(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    web = start_web(cluster)
    api = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "studiotui",
            "-i",
            str(inventory(cluster)),
            "serve",
            "--port",
            "57859",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env(cluster),
    )
    try:
        assert api.stdout is not None
        read_until(api.stdout, "studiotui serve: http")
        status = cli(cluster, "status", "--json")
        kinds = sorted(s["kind"] for s in json.loads(status.stdout)["services"])
        assert kinds == ["api", "web"], status.stdout
        down = cli(cluster, "down", "--all")
        assert down.returncode == 0
        assert "stopped browser view" in down.stdout and f"(pid {web.proc.pid})" in down.stdout
        assert f"stopped API server http://127.0.0.1:57859/v1 (pid {api.pid})" in down.stdout
        assert web.proc.wait(timeout=10) is not None and api.wait(timeout=10) is not None
        assert all(local_cluster.running_pid(n) is None for n in cluster.inventory.nodes)
    finally:
        for proc in (web.proc, api):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert cli(cluster, "up").returncode == 0
