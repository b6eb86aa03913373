"""An agent that cannot bind its control socket exits with a status that says why, and
`provision` says why from that status (not from the words of the agent's log)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from studiotui.cluster import keys
from studiotui.core.inventory import NodeSpec
from studiotui.provision.deploy import _died
from worker.shared import ports

# TEST-NET-1 (RFC 5737): never an address of this machine.
FOREIGN = "192.0.2.1"


def _agent_exit(bind: str, home: Path) -> tuple[int, str]:
    # The node's keys, as `up` and `provision` install them.
    keys.install_locally(home, keys.node_key_files(home.parent / "operator", "n1", ["n1"]))
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--bind", bind, "--home", str(home), "--name", "n1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stderr


@pytest.mark.integration
def test_an_agent_that_cannot_bind_exits_with_the_reason_s_status(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err = _agent_exit(f"127.0.0.1:{port}", tmp_path / "a")
    assert code == ports.EXIT_PORT_IN_USE, (code, err)
    assert f"cannot bind 127.0.0.1:{port}" in err, err
    code, err = _agent_exit(f"{FOREIGN}:{port}", tmp_path / "b")
    assert code == ports.EXIT_NOT_AN_ADDRESS, (code, err)


def test_provision_says_why_from_the_exit_status() -> None:
    node = NodeSpec(name="studio-2", address="10.0.0.12", control_port=28500)
    taken = _died(node, "~/studiotui", "(log)", ports.EXIT_PORT_IN_USE)
    assert "could not bind 10.0.0.12:28500: the port is already in use" in taken.message
    assert "lsof -nP -iTCP:28500" in taken.hint
    foreign = _died(node, "~/studiotui", "(log)", ports.EXIT_NOT_AN_ADDRESS)
    assert "it is not an address of studio-2" in foreign.message
    # Whatever the log says, an unknown status is not read as a bind failure.
    other = _died(node, "~/studiotui", "OSError: Address already in use", 1)
    assert "exited right after starting" in other.message
    assert other.log_tail == "OSError: Address already in use"
