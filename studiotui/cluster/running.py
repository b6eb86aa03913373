"""The API servers and browser dashboards running for a home: one pid file each.

`studiotui serve` and `studiotui web` write a file under STUDIOTUI_HOME/run when they
start and remove it when they stop; `web` writes one for each tab's dashboard process
too. `studiotui status` lists the ones alive and `studiotui down --all` stops them. A
file whose process is gone (killed hard), or whose pid now belongs to a process that
started after the file was written, is stale: skipped and removed, never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from studiotui.cluster.local_cluster import PID_CLOCK_SLACK_S, wait_gone

KINDS = {"api": "API server", "web": "browser view", "tab": "browser dashboard"}


@dataclass(frozen=True)
class Running:
    kind: str  # a key of KINDS
    pid: int
    started: float  # the process's start (Unix seconds), as psutil reads it
    what: str  # its address, or what it serves
    path: Path  # its pid file

    @property
    def label(self) -> str:
        return KINDS.get(self.kind, self.kind)


def run_dir(home: Path) -> Path:
    return home / "run"


def register(home: Path, kind: str, what: str, pid: int | None = None) -> Path:
    """Write the pid file of process `pid` (this one by default)."""
    pid = pid or os.getpid()
    folder = run_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}-{pid}.json"
    try:
        started = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        started = time.time()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"kind": kind, "pid": pid, "started": started, "what": what}))
    tmp.replace(path)
    return path


def unregister(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def alive(entry: Running) -> bool:
    """Whether the process the file names is still that process."""
    try:
        proc = psutil.Process(entry.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - entry.started) <= PID_CLOCK_SLACK_S
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def running(home: Path) -> list[Running]:
    """The live processes registered for `home`, oldest first; stale files removed."""
    out = []
    for path in sorted(run_dir(home).glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            entry = Running(
                kind=str(raw["kind"]),
                pid=int(raw["pid"]),
                started=float(raw["started"]),
                what=str(raw.get("what", "")),
                path=path,
            )
        except (OSError, ValueError, TypeError, KeyError):
            unregister(path)
            continue
        if alive(entry):
            out.append(entry)
        else:
            unregister(path)
    return sorted(out, key=lambda e: e.started)


def stop(entry: Running, timeout: float = 5.0) -> bool:
    """SIGTERM, then SIGKILL after `timeout`: True once the process is gone. A tab's
    dashboard runs in a process group of its own: the whole group is stopped."""
    if not alive(entry):
        unregister(entry.path)
        return True
    group = entry.kind == "tab" and _leads_group(entry.pid)
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(entry.pid, sig)
            else:
                os.kill(entry.pid, sig)
        if wait_gone(entry.pid, wait):
            unregister(entry.path)
            return True
    return False


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False
