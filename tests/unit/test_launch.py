"""The agent launcher (provision/remote.py LAUNCH_SNIPPET, run here by this python as it
runs on a node) says how its wait ended as fields: `state` one of LAUNCH_STATES and the
exit status apart, so provisioning decides on `Launched.state`, never on words."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from studiotui.provision.remote import Launched, launch_argv, parse_launch
from studiotui.ssh.client import SshError


def run_launcher(workdir: Path, port: int, argv: list[str], wait_s: float = 10.0) -> Launched:
    cmd = launch_argv(sys.executable, str(workdir), "", ("127.0.0.1", port), wait_s, argv)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return parse_launch("n1", out.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_an_agent_that_exits_is_exited_with_its_status(tmp_path: Path) -> None:
    launched = run_launcher(tmp_path, free_port(), [sys.executable, "-c", "raise SystemExit(3)"])
    assert (launched.state, launched.code) == ("exited", 3)
    assert launched.pid == int((tmp_path / "agent.pid").read_text())


def test_an_agent_that_listens_is_listening(tmp_path: Path) -> None:
    port = free_port()
    serve = (
        f"import socket, time\ns = socket.create_server(('127.0.0.1', {port}))\ntime.sleep(60)\n"
    )
    launched = run_launcher(tmp_path, port, [sys.executable, "-c", serve])
    try:
        assert (launched.state, launched.code) == ("listening", None)
    finally:
        os.kill(launched.pid, signal.SIGKILL)  # the one process this test started


def test_an_agent_that_does_neither_is_a_timeout(tmp_path: Path) -> None:
    launched = run_launcher(
        tmp_path, free_port(), [sys.executable, "-c", "import time; time.sleep(60)"], 0.5
    )
    try:
        assert (launched.state, launched.code) == ("timeout", None)
    finally:
        os.kill(launched.pid, signal.SIGKILL)


def test_the_launchers_lines_parse_into_fields() -> None:
    assert parse_launch("n1", "pid=12\nstate=exited\ncode=1\n") == Launched(12, "exited", 1)
    # A state it does not name (an older launcher's "exited 1") is not read for words.
    assert parse_launch("n1", "pid=12\nstate=exited 1\n") == Launched(12, "timeout")
    with pytest.raises(SshError, match="printed no pid"):
        parse_launch("n1", "state=listening\n")
