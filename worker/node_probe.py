"""Facts a node gathers about its network and RDMA (the I/O; parsing is in probes).

Every command runs with a short timeout and any failure becomes "unknown" plus a
note: a probe must never keep the agent from starting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from worker.shared import probes
from worker.shared.protocol.control import to_wire
from worker.shared.protocol.rdma import RdmaFacts, RdmaPort

TIMEOUT_S = 8.0
# The slow Thunderbolt listing is read again when the cheap probes see a change, and
# at least this often anyway (a Mac swapped at the far end of a cable, link unchanged).
THUNDERBOLT_AT_LEAST_EVERY_S = 1800.0
SYSTEM_PROFILER = ["system_profiler", "SPThunderboltDataType", "-json"]


@dataclasses.dataclass
class ProbeMemo:
    """What the last round of probes saw, kept by the agent between rounds: the cheap
    probes' link signal (probes.link_signal), the Thunderbolt bus read with it and when,
    and the commands the last round ran (by `replay_name`), for its log and tests."""

    signal: tuple[Any, ...] | None = None
    thunderbolt: probes.ThunderboltReport | None = None
    read_at: float = 0.0
    ran: list[str] = dataclasses.field(default_factory=list)


def thunderbolt_again(memo: ProbeMemo, signal: tuple[Any, ...], now: float) -> bool:
    """Whether this round reads the Thunderbolt bus again: the first round, a change in
    the cheap probes, a last listing that failed, or a long time since."""
    return (
        memo.thunderbolt is None
        or memo.signal != signal
        or now - memo.read_at >= THUNDERBOLT_AT_LEAST_EVERY_S
    )


# A folder of recorded command outputs in a node's work directory: when it is there,
# the agent reports what they say instead of running the commands (see `replayer`).
REPLAY_FOLDER = "probe-replay"


def _run(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def replay_name(argv: Sequence[str]) -> str:
    """The file a recorded output of `argv` is replayed from: its words joined by "_"
    ("system_profiler_SPThunderboltDataType_-json"), as tests/fixtures/macos names them."""
    return "_".join(argv)


def replayer(folder: Path) -> Callable[[list[str]], str | None]:
    """A `_run` that reads each command's recorded output from `folder` instead of
    running it; a command with no file there is one that failed. It lets a machine that
    is not a Mac (a test's local agents, or a support session) report what a Mac's
    commands printed, through the same parsers."""

    def run(argv: list[str]) -> str | None:
        path = folder / replay_name(argv)
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            return None

    return run


def _parse(parser: Any, text: str | None, default: Any) -> Any:
    if text is None:
        return default
    try:
        return parser(text)
    except probes.ProbeParseError:
        return default


def rdma_facts(replay: Path | None = None, memo: ProbeMemo | None = None) -> dict[str, Any]:
    """What `rdma_ctl`, `ibv_devices`, `ibv_devinfo`, the Thunderbolt bus, the hardware
    ports and bridge0 say (a `RdmaFacts` as a plain map), and the steps to turn RDMA on
    where it is off. With `replay` (a folder of recorded outputs, see `replayer`) the
    node reports what those outputs say, as a Mac would.

    With `memo` (the agent's, from the last round) the slow Thunderbolt listing is read
    again only when the cheap probes changed (`thunderbolt_again`); else the bus it read
    last time stands."""
    system = platform.system()
    mac = system == "Darwin" or replay is not None
    memo = memo if memo is not None else ProbeMemo()
    memo.ran = []
    command = replayer(replay) if replay is not None else _run

    def run(argv: list[str]) -> str | None:
        memo.ran.append(replay_name(argv))
        return command(argv)

    os_name = "macOS" if mac else system
    if replay is not None:
        version = (run(["sw_vers", "-productVersion"]) or "").strip()
    else:
        version = platform.mac_ver()[0] if system == "Darwin" else platform.release()
    port_map: tuple[probes.ThunderboltPort, ...] = ()
    if mac:
        status = _parse(probes.parse_rdma_ctl_status, run(["rdma_ctl", "status"]), "unknown")
        devices = _parse(probes.parse_ibv_devices, run(["ibv_devices"]), ())
        ports = _parse(probes.parse_ibv_devinfo, run(["ibv_devinfo"]), ())
        hardware = _parse(
            probes.parse_networksetup_ports, run(["networksetup", "-listallhardwareports"]), ()
        )
        ifconfig = _parse(probes.parse_ifconfig, run(["ifconfig"]), {})
        signal = probes.link_signal(ifconfig, hardware, ports)
        now = time.monotonic()
        if thunderbolt_again(memo, signal, now):
            memo.thunderbolt = _parse(probes.parse_thunderbolt_json, run(SYSTEM_PROFILER), None)
            memo.signal, memo.read_at = signal, now
        tb = memo.thunderbolt
        if tb is not None:
            port_map = probes.thunderbolt_port_map(tb, hardware, devices, ports, ifconfig)
    else:
        status, ports, tb, ifconfig = "unknown", (), None, {}
        devices = tuple(probes.IbvDevice(name=p.name, guid="") for p in _infiniband_dir().glob("*"))
    summary = probes.rdma_summary(status, devices, tb, ifconfig, ports)
    facts = RdmaFacts(
        os=os_name,
        os_version=version,
        status=summary.status,
        usable=summary.usable,
        devices=summary.devices,
        active_devices=summary.active_devices,
        peers=tuple(p.name for p in summary.peers),
        bridge_exists=summary.bridge_exists,
        bridge_members=summary.bridge_members,
        bridge_active=summary.bridge_active,
        notes=summary.notes,
        steps=tuple(probes.rdma_enable_steps(summary, os_name, version)),
        ports=tuple(
            RdmaPort(
                receptacle=p.receptacle,
                domain_uuid=p.domain_uuid,
                interface=p.interface,
                device=p.rdma_device,
                state=p.state,
                peer_uuid=p.peer_uuid,
                peer_model=p.peer_model,
                link_gbps=p.link_gbps,
                ipv4=p.ipv4,
            )
            for p in port_map
        ),
    )
    return to_wire(facts)


def _infiniband_dir() -> Path:
    return Path("/sys/class/infiniband")


def link_end(address: str) -> dict[str, Any]:
    """The interface the agent's bind address sits on, its prefix and (macOS) its
    hardware port label: the facts `probes.pair_link_kind` needs from this end."""
    interface, prefix = None, None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.address == address:
                interface = name
                with contextlib.suppress(ValueError, TypeError):
                    if a.netmask:
                        prefix = ipaddress.ip_network(f"0.0.0.0/{a.netmask}").prefixlen
    port = None
    if interface and platform.system() == "Darwin":
        ports = _parse(
            probes.parse_networksetup_ports, _run(["networksetup", "-listallhardwareports"]), ()
        )
        port = next((p.port for p in ports if p.device == interface), None)
    end = probes.LinkEnd(address, interface, port, prefix)
    return {**dataclasses.asdict(end), "kind": probes.end_kind(end)}
