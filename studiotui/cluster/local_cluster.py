"""Agents on this machine: the simulated cluster, and any `transport = "local"` node.

Each agent is started detached (its own session) so it outlives the command that
started it; its pid is kept in its work dir and used, and only it, to stop it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from studiotui.cluster import keys, stops
from studiotui.core.inventory import (
    DEFAULT_CONTROL_PORT,
    Inventory,
    InventoryError,
    NodeSpec,
    dump_inventory,
    load_inventory,
    local_inventory,
)
from worker.shared.ports import port_free
from worker.shared.protocol.limits import tail_lines


def local_inventory_path(home: Path) -> Path:
    return home / "local" / "cluster.toml"


def write_local_inventory(
    home: Path, n: int, memory_gb: float | None, control_port: int = DEFAULT_CONTROL_PORT
) -> Inventory:
    inv = local_inventory(n, home=home, memory_gb=memory_gb, control_port=control_port)
    save_local_inventory(home, inv)
    return inv


def save_local_inventory(home: Path, inv: Inventory) -> None:
    path = local_inventory_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_inventory(inv, over=_text_of(path)))


def _text_of(path: Path) -> str | None:
    """The file a write replaces, so its comments and order are kept (None: none yet)."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def running_outside(home: Path, new: Inventory) -> list[str]:
    """The running agents of the saved local cluster that `new` drops or moves to
    another address or port: writing `new` over it would orphan them, since `down`
    stops only the nodes the inventory names."""
    path = local_inventory_path(home)
    try:
        old = load_inventory(path)
    except (OSError, InventoryError):
        return []  # none saved, or one nothing could have started from
    kept = {(n.name, n.address, n.control_port) for n in new.nodes}
    return [
        n.name
        for n in old.nodes
        if n.is_local
        and (n.name, n.address, n.control_port) not in kept
        and running_pid(n) is not None
    ]


def ports_taken(inv: Inventory) -> list[str]:
    """The agent ports (control, telemetry) of `inv`'s local nodes that something else
    holds now: another simulated cluster (another STUDIOTUI_HOME's) or any program.
    A node whose own agent runs holds its ports itself."""
    return [
        f"{node.address}:{port}"
        for node in inv.nodes
        if node.is_local and running_pid(node) is None
        for port in (node.control_port, node.telemetry_port)
        if not port_free(node.address, port)
    ]


def pid_file(node: NodeSpec) -> Path:
    return Path(node.workdir).expanduser() / "agent.pid"


# psutil's start times are counted from a boot time known to the second.
PID_CLOCK_SLACK_S = 2.0


def running_pid(node: NodeSpec) -> int | None:
    """The pid of this node's agent if it is alive and really is that agent.

    A pid file outlives its agent when the agent is killed hard, and its pid may be
    given to any later process, one that may even look like an agent of ours. The
    file is written after its agent started (by the starter, then by the agent), so
    a process that started after the file was written is not the one it names.
    """
    path = pid_file(node)
    try:
        pid = int(path.read_text().strip())
        written = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    try:
        proc = psutil.Process(pid)
        cmdline, started = proc.cmdline(), proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if started > written + PID_CLOCK_SLACK_S:
        return None
    return pid if is_agent_command(cmdline, Path(node.workdir)) else None


def is_agent_command(cmdline: list[str], workdir: Path) -> bool:
    """`python -m worker ... --home WORKDIR`: the argv start_agent gives an agent."""
    home = str(workdir.expanduser().resolve())
    pairs = list(itertools.pairwise(cmdline))
    return ("-m", "worker") in pairs and ("--home", home) in pairs


def start_agent(home: Path, node: NodeSpec, inventory: Inventory) -> int:
    workdir = Path(node.workdir).expanduser().resolve()
    if not workdir.exists():
        workdir.mkdir(parents=True, mode=0o700)  # keys, logs with prompts, model paths
    keys.install_locally(workdir, keys.node_key_files(home, node.name, list(inventory.names)))
    stops.forget_stops(home, inventory.name, [node.name])  # started again: not `down`'s
    pid = running_pid(node)
    if pid is not None:
        return pid
    # Only an absolute path is taken: a bare name would be looked up in the directory
    # the command runs from (a ./python3 beside a downloaded cluster.toml).
    python = Path(node.python).expanduser() if node.python else None
    argv = [
        str(python) if python and python.is_absolute() and python.exists() else sys.executable,
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
    fd = os.open(workdir / "agent.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=workdir,
        )
    fd = os.open(pid_file(node), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(str(proc.pid))
    return proc.pid


def agent_output_tail(node: NodeSpec, lines: int = 10) -> str:
    return "\n".join(tail_lines(Path(node.workdir).expanduser() / "agent.out", lines))


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
