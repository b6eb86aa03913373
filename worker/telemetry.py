"""What a node reports about itself each second (I/O here; parsing in probes).

Power and memory pressure come from whatever the machine offers (macmon,
powermetrics, memory_pressure/vm_stat on macOS; RAPL and PSI on Linux) or say
why there is no figure: never an invented one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from worker.shared import probes


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


# ---------------------------------------------------------------------------
# Power and memory pressure: which source this machine has (pure, from facts
# gathered once), and reading it (commands through an injected runner).
# ---------------------------------------------------------------------------

Runner = Callable[[Sequence[str], float], str | None]
COMMAND_TIMEOUT_S = 10.0
# macmon and powermetrics sample over a second and cost a process each time:
# every few seconds is plenty for a card. Files (RAPL, PSI) are cheap.
COMMAND_EVERY_S = 5.0
FILE_EVERY_S = 2.0
MACMON_ARGV = ("macmon", "pipe", "--samples", "1", "--interval", "1000")
POWERMETRICS_ARGV = ("powermetrics", "--samplers", "cpu_power,gpu_power", "-n", "1", "-i", "1000")
_RAPL_ZONE = re.compile(r"^[a-z]+-rapl:\d+$")  # top-level zones: packages and psys


@dataclass(frozen=True)
class PowerFacts:
    """What this machine offers for power and pressure, gathered once."""

    system: str  # platform.system(): Darwin, Linux, ...
    tools: frozenset[str] = frozenset()  # of macmon, powermetrics, memory_pressure, vm_stat
    is_root: bool = False
    sudo_powermetrics: bool = False  # `sudo -n` may run powermetrics without a password
    rapl_zones: tuple[str, ...] = ()  # readable top-level zone directories
    rapl_note: str = ""  # why there are none
    psi_path: str = ""  # readable /proc/pressure/memory, or ""
    psi_note: str = ""


@dataclass(frozen=True)
class Source:
    kind: str  # macmon, powermetrics, rapl, memory_pressure, vm_stat, psi, or "" for none
    argv: tuple[str, ...] = ()
    reason: str = ""  # with kind "": why not, said to the operator


def choose_power_source(facts: PowerFacts) -> Source:
    if facts.system == "Darwin":
        if "macmon" in facts.tools:
            return Source("macmon", MACMON_ARGV)
        if "powermetrics" in facts.tools and facts.is_root:
            return Source("powermetrics", POWERMETRICS_ARGV)
        if "powermetrics" in facts.tools and facts.sudo_powermetrics:
            return Source("powermetrics", ("sudo", "-n", *POWERMETRICS_ARGV))
        return Source(
            "",
            reason="macmon is not installed (brew install macmon) and powermetrics needs "
            "root: run the agent as root or allow it `sudo -n powermetrics`",
        )
    if facts.system == "Linux":
        if facts.rapl_zones:
            return Source("rapl", facts.rapl_zones)
        return Source("", reason=facts.rapl_note or "no RAPL zones in /sys/class/powercap")
    return Source("", reason=f"power is not measured on {facts.system}")


def choose_pressure_source(facts: PowerFacts) -> Source:
    if facts.system == "Darwin":
        if "memory_pressure" in facts.tools:
            return Source("memory_pressure", ("memory_pressure", "-Q"))
        if "vm_stat" in facts.tools:
            return Source("vm_stat", ("vm_stat",))
        return Source("", reason="neither memory_pressure nor vm_stat is on PATH")
    if facts.system == "Linux":
        if facts.psi_path:
            return Source("psi", (facts.psi_path,))
        return Source("", reason=facts.psi_note or "no /proc/pressure/memory")
    return Source("", reason=f"memory pressure is not read on {facts.system}")


def gather_power_facts(
    which: Callable[[str], str | None] = shutil.which,
    runner: Runner | None = None,
    powercap: Path = Path("/sys/class/powercap"),
    psi: Path = Path("/proc/pressure/memory"),
    system: str | None = None,
) -> PowerFacts:
    system = system or platform.system()
    run = runner or run_command
    if system == "Darwin":
        tools = frozenset(
            t for t in ("macmon", "powermetrics", "memory_pressure", "vm_stat") if which(t)
        )
        root = os.geteuid() == 0
        sudo = False
        if "powermetrics" in tools and "macmon" not in tools and not root and which("sudo"):
            # -n: never prompt; -l CMD: exit 0 only if CMD is allowed.
            sudo = (
                run(["sudo", "-n", "-l", which("powermetrics") or "powermetrics"], 5.0) is not None
            )
        return PowerFacts(system, tools, root, sudo)
    if system == "Linux":
        zones, note = _rapl_zones(powercap)
        psi_ok, psi_note = _readable(psi)
        return PowerFacts(
            system,
            rapl_zones=zones,
            rapl_note=note,
            psi_path=str(psi) if psi_ok else "",
            psi_note=psi_note,
        )
    return PowerFacts(system)


def _readable(path: Path) -> tuple[bool, str]:
    try:
        path.read_text()
    except FileNotFoundError:
        return False, f"{path} does not exist (kernel without pressure stall information)"
    except OSError as exc:
        return False, f"{path} is not readable: {exc.strerror or exc}"
    return True, ""


def _rapl_zones(powercap: Path) -> tuple[tuple[str, ...], str]:
    if not powercap.is_dir():
        return (), f"no RAPL: {powercap} does not exist (no powercap driver, or a VM)"
    zones = sorted(p for p in powercap.iterdir() if _RAPL_ZONE.match(p.name))
    if not zones:
        return (), f"no RAPL zones in {powercap}"
    readable = [z for z in zones if _readable(z / "energy_uj")[0]]
    if not readable:
        return (), (
            f"RAPL energy counters in {powercap} are readable by root only (since Linux 5.10): "
            "run the agent as root or grant read access to energy_uj"
        )
    return tuple(str(z) for z in readable), ""


def run_command(argv: Sequence[str], timeout: float) -> str | None:
    """stdout of a command that exited 0 within `timeout`, else None."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


class Meter:
    """Reads the chosen power and pressure sources; `read` blocks (commands run
    up to COMMAND_TIMEOUT_S), so the agent calls it in a thread."""

    def __init__(
        self,
        power: Source,
        pressure: Source,
        runner: Runner = run_command,
        read_file: Callable[[str], str] = lambda path: Path(path).read_text(),
        clock: Callable[[], float] = time.monotonic,
        host: str = "",
    ) -> None:
        self.power_source, self.pressure_source = power, pressure
        self.runner, self.read_file, self.clock = runner, read_file, clock
        self.host = host or socket.gethostname()
        self._rapl_before: tuple[float, dict[str, int]] | None = None
        commands = power.kind in ("macmon", "powermetrics")
        self.every_s = COMMAND_EVERY_S if commands else FILE_EVERY_S

    @classmethod
    def for_this_machine(cls) -> Meter:
        facts = gather_power_facts()
        return cls(choose_power_source(facts), choose_pressure_source(facts))

    def read(self) -> dict[str, Any]:
        """{"power": {...}, "pressure": {...}} and, from macmon, "gpu_pct"."""
        out: dict[str, Any] = {}
        out["power"] = self._power(out)
        out["pressure"] = self._pressure()
        return out

    def _power(self, out: dict[str, Any]) -> dict[str, Any]:
        src = self.power_source
        base: dict[str, Any] = {"source": src.kind or None, "host": self.host}
        if not src.kind:
            return {**base, "reason": src.reason}
        try:
            if src.kind == "rapl":
                return {**base, **self._rapl(src.argv)}
            text = self.runner(src.argv, COMMAND_TIMEOUT_S)
            if text is None:
                return {**base, "reason": f"{' '.join(src.argv)} failed or timed out"}
            if src.kind == "macmon":
                s = probes.parse_macmon_line(text)
                if s.gpu_usage is not None:
                    out["gpu_pct"] = s.gpu_usage * 100
                # sys_power is the whole machine (SMC); all_power only CPU+GPU+ANE.
                total, scope = (
                    (s.sys_power_w, "system") if s.sys_power_w else (s.all_power_w, "soc")
                )
                return {
                    **base,
                    "total_w": total,
                    "scope": scope,
                    "cpu_w": s.cpu_power_w,
                    "gpu_w": s.gpu_power_w,
                    "ane_w": s.ane_power_w,
                }
            p = probes.parse_powermetrics(text)
            return {
                **base,
                "total_w": p.combined_w,
                "scope": "soc",
                "cpu_w": p.cpu_w,
                "gpu_w": p.gpu_w,
                "ane_w": p.ane_w,
            }
        except (probes.ProbeParseError, OSError, ValueError) as exc:
            return {**base, "reason": str(exc)}

    def _rapl(self, zones: Sequence[str]) -> dict[str, Any]:
        now = self.clock()
        reading: dict[str, int] = {}
        ranges: dict[str, int] = {}
        for zone in zones:
            reading[zone] = int(self.read_file(f"{zone}/energy_uj").strip())
            with contextlib.suppress(OSError, ValueError):
                ranges[zone] = int(self.read_file(f"{zone}/max_energy_range_uj").strip())
        before, self._rapl_before = self._rapl_before, (now, reading)
        if before is None:
            return {"reason": "measuring (RAPL needs two readings)"}
        # psys, where the platform has it, covers the whole SoC; packages otherwise.
        names = {z: self.read_file(f"{z}/name").strip() for z in zones}
        psys = [z for z in zones if names[z] == "psys"]
        packages = [z for z in zones if names[z] != "psys"]
        elapsed = now - before[0]
        cpu = probes.rapl_watts(
            _only(before[1], packages), _only(reading, packages), elapsed, ranges
        )
        total = (
            probes.rapl_watts(_only(before[1], psys), _only(reading, psys), elapsed, ranges)
            if psys
            else cpu
        )
        if total is None:
            return {"reason": "RAPL counters did not advance"}
        return {"total_w": total, "scope": "platform" if psys else "package", "cpu_w": cpu}

    def _pressure(self) -> dict[str, Any]:
        src = self.pressure_source
        if not src.kind:
            return {"source": None, "reason": src.reason}
        try:
            if src.kind == "psi":
                psi = probes.parse_psi(self.read_file(src.argv[0]))
                # The share of the last 10 s that some task waited for memory.
                return {"source": "psi", "pct": psi.some_avg10, "label": "stall"}
            text = self.runner(src.argv, COMMAND_TIMEOUT_S)
            if text is None:
                return {"source": src.kind, "reason": f"{' '.join(src.argv)} failed"}
            if src.kind == "memory_pressure":
                free = probes.parse_memory_pressure(text).free_percent
                return {"source": src.kind, "pct": float(100 - free), "label": "pressure"}
            vm = probes.parse_vm_stat(text)
            whole = vm.used_bytes + vm.available_bytes
            pct = 100.0 * vm.used_bytes / whole if whole else 0.0
            return {"source": src.kind, "pct": pct, "label": "pressure"}
        except (probes.ProbeParseError, OSError, ValueError) as exc:
            return {"source": src.kind, "reason": str(exc)}


def _only(reading: dict[str, int], zones: Sequence[str]) -> dict[str, int]:
    return {z: v for z, v in reading.items() if z in zones}


async def keep_reading(meter: Meter, into: dict[str, Any]) -> None:
    """Refresh `into` (merged into every telemetry message) off the event loop."""
    while True:
        into.update(await asyncio.to_thread(meter.read))
        await asyncio.sleep(meter.every_s)
