"""Agents on this machine: the simulated cluster, and any `transport = "local"` node.

Each agent is started detached (its own session) so it outlives the command that
started it; its pid is kept in its work dir and used, and only it, to stop it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from studiotui.cluster import keys
from studiotui.core.inventory import (
    DEFAULT_CONTROL_PORT,
    Inventory,
    NodeSpec,
    dump_inventory,
    local_inventory,
)


def local_inventory_path(home: Path) -> Path:
    return home / "local" / "cluster.toml"


def write_local_inventory(
    home: Path, n: int, memory_gb: float | None, control_port: int = DEFAULT_CONTROL_PORT
) -> Inventory:
    inv = local_inventory(n, home=home, memory_gb=memory_gb, control_port=control_port)
    path = local_inventory_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_inventory(inv))
    return inv


def pid_file(node: NodeSpec) -> Path:
    return Path(node.workdir).expanduser() / "agent.pid"


def running_pid(node: NodeSpec) -> int | None:
    """The pid of this node's agent if it is alive and really is that agent."""
    try:
        pid = int(pid_file(node).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    workdir = str(Path(node.workdir).expanduser().resolve())
    return pid if "worker" in " ".join(cmdline) and workdir in cmdline else None


def start_agent(home: Path, node: NodeSpec, inventory: Inventory) -> int:
    workdir = Path(node.workdir).expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    keys.install_locally(workdir, keys.node_key_files(home, node.name, list(inventory.names)))
    pid = running_pid(node)
    if pid is not None:
        return pid
    argv = [
        node.python if node.python and Path(node.python).exists() else sys.executable,
        "-m",
        "worker",
        "--bind",
        f"{node.address}:{node.control_port}",
        "--home",
        str(workdir),
        "--name",
        node.name,
    ]
    if node.memory_gb:
        argv += ["--memory-gb", str(node.memory_gb)]
    with open(workdir / "agent.out", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=workdir,
        )
    pid_file(node).write_text(str(proc.pid))
    return proc.pid


def agent_output_tail(node: NodeSpec, lines: int = 10) -> str:
    path = Path(node.workdir).expanduser() / "agent.out"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_agent(node: NodeSpec, timeout: float = 5.0) -> bool:
    """Stop this node's agent by its pid: TERM, then KILL after `timeout`."""
    pid = running_pid(node)
    if pid is None:
        return False
    kill_pid(pid, timeout)
    with contextlib.suppress(FileNotFoundError):
        pid_file(node).unlink()
    return True


def kill_pid(pid: int, timeout: float = 5.0) -> None:
    """Stop one process we started ourselves, known by its pid."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_gone(pid, 2.0)


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
