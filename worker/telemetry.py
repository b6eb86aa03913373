"""What a node reports about itself each second (I/O here; parsing in probes)."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import psutil


def machine_facts(memory_gb: float | None) -> dict[str, Any]:
    total = int(memory_gb * 1024**3) if memory_gb else psutil.virtual_memory().total
    return {
        "os": platform.system(),
        "os_version": platform.release()
        if platform.system() != "Darwin"
        else platform.mac_ver()[0],
        "arch": platform.machine(),
        "chip": _chip(),
        "cpus": os.cpu_count() or 1,
        "memory_total": total,
        "python": platform.python_version(),
        "simulated": memory_gb is not None,
    }


def _chip() -> str:
    if platform.system() == "Darwin":
        return platform.processor() or "Apple Silicon"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sample(memory_gb: float | None, runner_pids: list[int]) -> dict[str, Any]:
    """Memory and load now. A simulated node counts only its own processes' memory
    against its advertised total, so loading a shard shows on its bar."""
    vm = psutil.virtual_memory()
    own = _rss([os.getpid(), *runner_pids])
    if memory_gb:
        total = int(memory_gb * 1024**3)
        used = min(total, own)
    else:
        total, used = vm.total, vm.total - vm.available
    return {
        "time": time.time(),
        "memory_total": total,
        "memory_used": used,
        "memory_own": own,
        # A simulated node shares the machine: its load is its own processes' CPU.
        "cpu_pct": _own_cpu([os.getpid(), *runner_pids])
        if memory_gb
        else psutil.cpu_percent(interval=None),
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
    }


_procs: dict[int, psutil.Process] = {}


def _own_cpu(pids: list[int]) -> float:
    """Percent of the machine's CPU these processes used since the last call."""
    total = 0.0
    for pid in pids:
        proc = _procs.get(pid)
        try:
            if proc is None:
                proc = _procs[pid] = psutil.Process(pid)
                proc.cpu_percent(interval=None)  # the first call only starts the clock
                continue
            total += proc.cpu_percent(interval=None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            _procs.pop(pid, None)
    for gone in set(_procs) - set(pids):
        del _procs[gone]
    return min(100.0, total / (psutil.cpu_count() or 1))


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total
