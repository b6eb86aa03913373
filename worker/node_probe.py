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
from pathlib import Path
from typing import Any

import psutil

from worker.shared import probes

TIMEOUT_S = 8.0


def _run(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _parse(parser: Any, text: str | None, default: Any) -> Any:
    if text is None:
        return default
    try:
        return parser(text)
    except probes.ProbeParseError:
        return default


def rdma_facts() -> dict[str, Any]:
    """What `rdma_ctl`, `ibv_devices`, the Thunderbolt bus and bridge0 say, and the
    steps to turn RDMA on where it is off."""
    system = platform.system()
    os_name = "macOS" if system == "Darwin" else system
    version = platform.mac_ver()[0] if system == "Darwin" else platform.release()
    if system == "Darwin":
        status = _parse(probes.parse_rdma_ctl_status, _run(["rdma_ctl", "status"]), "unknown")
        devices = _parse(probes.parse_ibv_devices, _run(["ibv_devices"]), ())
        ports = _parse(probes.parse_ibv_devinfo, _run(["ibv_devinfo"]), ())
        tb = _parse(
            probes.parse_thunderbolt_json,
            _run(["system_profiler", "SPThunderboltDataType", "-json"]),
            None,
        )
        ifconfig = _parse(probes.parse_ifconfig, _run(["ifconfig"]), {})
    else:
        status, ports, tb, ifconfig = "unknown", (), None, {}
        devices = tuple(probes.IbvDevice(name=p.name, guid="") for p in _infiniband_dir().glob("*"))
    summary = probes.rdma_summary(status, devices, tb, ifconfig, ports)
    return {
        "os": os_name,
        "os_version": version,
        "status": summary.status,
        "usable": summary.usable,
        "devices": list(summary.devices),
        "active_devices": list(summary.active_devices),
        "peers": [p.name for p in summary.peers],
        "bridge_exists": summary.bridge_exists,
        "bridge_members": list(summary.bridge_members),
        "bridge_active": summary.bridge_active,
        "notes": list(summary.notes),
        "steps": probes.rdma_enable_steps(summary, os_name, version),
    }


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
