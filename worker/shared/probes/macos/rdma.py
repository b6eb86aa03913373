"""macOS RDMA probes: rdma_ctl, ibv_devices, ibv_devinfo, and from them (with the
Thunderbolt report and the interfaces) the RDMA summary and the human steps to enable it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from worker.shared.probes.common import Interface, ProbeParseError, probe_parser
from worker.shared.probes.macos.thunderbolt import ThunderboltItem, ThunderboltReport

MIN_RDMA_MACOS = (26, 2)

RdmaStatus = Literal["enabled", "disabled", "unknown"]

# ---------------------------------------------------------------------------
# rdma_ctl, ibv_devices, ibv_devinfo
# ---------------------------------------------------------------------------


@probe_parser("rdma_ctl status")
def parse_rdma_ctl_status(text: str) -> RdmaStatus:
    """`rdma_ctl status` prints one word. Empty output (tool absent) or the tool's
    own complaint (e.g. about Recovery OS) is "unknown"; anything else is garbage."""
    words = set(re.findall(r"[a-z_]+", text.lower()))
    if "enabled" in words and "disabled" not in words:
        return "enabled"
    if "disabled" in words and "enabled" not in words:
        return "disabled"
    if not text.strip() or "rdma_ctl" in words:
        return "unknown"
    raise ProbeParseError("rdma_ctl status", f"unexpected output {text.strip()[:60]!r}")


@dataclass(frozen=True)
class IbvDevice:
    name: str
    guid: str


_IBV_ROW = re.compile(r"^\s*(\S+)\s+([0-9a-fA-F]{16})\s*$")


@probe_parser("ibv_devices")
def parse_ibv_devices(text: str) -> tuple[IbvDevice, ...]:
    """Devices in printed order (not sorted: M3 Ultra lists rdma_en5 before rdma_en4)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not re.match(r"^\s*device\s+node GUID\s*$", lines[0]):
        raise ProbeParseError("ibv_devices", "no 'device  node GUID' header")
    devices = []
    for line in lines[1:]:
        if re.match(r"^\s*-+\s+-+\s*$", line):
            continue
        m = _IBV_ROW.match(line)
        if not m:
            raise ProbeParseError("ibv_devices", f"unreadable row {line.strip()[:60]!r}")
        devices.append(IbvDevice(name=m.group(1), guid=m.group(2).lower()))
    return tuple(devices)


@dataclass(frozen=True)
class IbvPort:
    """One port of an `ibv_devinfo` device. Fields Apple's elided excerpts omit are None."""

    device: str
    port: int
    state: str | None = None
    active_mtu: int | None = None
    link_layer: str | None = None
    transport: str | None = None
    node_guid: str | None = None
    max_mtu: int | None = None
    active_width: str | None = None
    active_speed: str | None = None
    gids: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "PORT_ACTIVE"


# A key is a word (or "GID[  n]") right after whitespace and followed by ":" and
# whitespace. Working on keys rather than lines survives Apple's re-wrapped
# excerpt, where several "key: value" pairs share a line; requiring whitespace
# after ":" keeps GUIDs and IPv6 GIDs ("fe80::...") out.
_DEVINFO_KEY = re.compile(r"(?:(?<=\s)|^)([A-Za-z_]\w*|GID\[\s*\d+\]):(?=\s|$)", re.M)


def _devinfo_pairs(text: str) -> list[tuple[str, str]]:
    keys = list(_DEVINFO_KEY.finditer(text))
    pairs = []
    for m, nxt in zip(keys, [*keys[1:], None], strict=True):
        raw = text[m.end() : nxt.start() if nxt else len(text)]
        # "..." marks lines Apple elided; whatever follows it is not this value.
        value = " ".join(raw.split("...")[0].split())
        pairs.append((re.sub(r"\s+", "", m.group(1)), value))
    return pairs


def _leading_int(value: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", value or "")
    return int(m.group(1)) if m else None


def _ibv_port(device: str, dev_fields: dict[str, str], port: dict[str, str]) -> IbvPort:
    state = port.get("state")
    return IbvPort(
        device=device,
        port=_leading_int(port.get("port")) or 0,
        state=state.split()[0] if state else None,
        active_mtu=_leading_int(port.get("active_mtu")),
        link_layer=port.get("link_layer") or None,
        transport=dev_fields.get("transport") or None,
        node_guid=dev_fields.get("node_guid") or None,
        max_mtu=_leading_int(port.get("max_mtu")),
        active_width=port.get("active_width") or None,
        active_speed=port.get("active_speed") or None,
        gids=tuple(v for k, v in port.items() if k.startswith("GID[") and v),
    )


@probe_parser("ibv_devinfo")
def parse_ibv_devinfo(text: str) -> tuple[IbvPort, ...]:
    """Every port of every device, in printed order; tolerant of elided lines."""
    if not text.strip() or "No IB devices found" in text:
        return ()
    ports: list[IbvPort] = []
    device: str | None = None
    dev_fields: dict[str, str] = {}
    port: dict[str, str] | None = None
    for key, value in _devinfo_pairs(text):
        if key == "hca_id":
            if device and port is not None:
                ports.append(_ibv_port(device, dev_fields, port))
            device, dev_fields, port = value, {}, None
        elif device is None:
            raise ProbeParseError("ibv_devinfo", f"field {key!r} before any 'hca_id:'")
        elif key == "port":
            if port is not None:
                ports.append(_ibv_port(device, dev_fields, port))
            port = {"port": value}
        else:
            (dev_fields if port is None else port)[key] = value
    if device is None:
        raise ProbeParseError("ibv_devinfo", "no 'hca_id:' line")
    if port is not None:
        ports.append(_ibv_port(device, dev_fields, port))
    return tuple(ports)


# ---------------------------------------------------------------------------
# RDMA summary and the human steps to enable it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RdmaSummary:
    status: RdmaStatus
    usable: bool
    devices: tuple[str, ...]
    interfaces: tuple[str, ...]
    active_devices: tuple[str, ...] = ()
    peers: tuple[ThunderboltItem, ...] = ()
    bridge_exists: bool = False
    bridge_members: tuple[str, ...] = ()
    bridge_active: bool = False
    notes: tuple[str, ...] = ()


def _rdma_notes(s: RdmaSummary, ifconfig: Mapping[str, Interface], ports_known: bool) -> list[str]:
    notes = []
    if s.status == "disabled":
        notes.append("RDMA is disabled (rdma_ctl status).")
    if s.status == "enabled" and not s.devices:
        notes.append(
            "rdma_ctl says enabled but ibv_devices lists no rdma_enX device: this Mac's "
            "Thunderbolt ports may not support RDMA (it needs Thunderbolt 5)."
        )
    if s.bridge_members:
        notes.append(
            f"The Thunderbolt Bridge bridge0 still has members {', '.join(s.bridge_members)}; "
            "Apple's TN3205 advises RDMA clusters to remove the Thunderbolt ports from it."
        )
    if ports_known and s.devices and not s.active_devices:
        notes.append(
            "No RDMA port is PORT_ACTIVE: a port comes up only when the Macs at both "
            "ends of the cable have RDMA enabled."
        )
    for iface in s.interfaces:
        if iface in ifconfig and not ifconfig[iface].ipv4 and iface not in s.bridge_members:
            notes.append(f"{iface} has no IPv4 address; MLX's JACCL backend needs one per port.")
    return notes


def rdma_summary(
    rdma_ctl: RdmaStatus | str | None,
    ibv_devices: Sequence[IbvDevice],
    thunderbolt: ThunderboltReport | None,
    ifconfig: Mapping[str, Interface],
    ibv_ports: Sequence[IbvPort] = (),
) -> RdmaSummary:
    """Pure verdict on RDMA over Thunderbolt from already-parsed probes.

    Usable means ibv_devices lists rdma_enX devices and rdma_ctl does not say
    disabled. `ibv_ports` (from ibv_devinfo) is optional; without it
    `active_devices` stays empty and no port-state note is made.
    """
    status: RdmaStatus = "unknown"
    if rdma_ctl == "enabled":
        status = "enabled"
    elif rdma_ctl == "disabled":
        status = "disabled"
    devices = tuple(d.name for d in ibv_devices if d.name.startswith("rdma_"))
    bridge = ifconfig.get("bridge0")
    summary = RdmaSummary(
        status=status,
        usable=bool(devices) and status != "disabled",
        devices=devices,
        interfaces=tuple(d.removeprefix("rdma_") for d in devices),
        active_devices=tuple(dict.fromkeys(p.device for p in ibv_ports if p.active)),
        peers=thunderbolt.peers if thunderbolt else (),
        bridge_exists=bridge is not None,
        bridge_members=bridge.members if bridge else (),
        bridge_active=bool(bridge and bridge.active),
    )
    notes = _rdma_notes(summary, ifconfig, ports_known=bool(ibv_ports))
    return replace(summary, notes=tuple(notes))


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", version or "")
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


_MAC_NAMES = ("darwin", "macos", "mac os x", "macosx", "osx")

_BRIDGE_STEP = (
    "Remove the Thunderbolt ports from the Thunderbolt Bridge (System Settings > "
    "Network > Thunderbolt Bridge, or delete that service) so each port keeps its own "
    "address; Apple's TN3205 advises this for RDMA clusters."
)


class RdmaVerdict(Protocol):
    """What the steps depend on: an RdmaSummary on the node, the agent's typed report
    (protocol.rdma.RdmaFacts) on the operator."""

    @property
    def usable(self) -> bool: ...

    @property
    def devices(self) -> tuple[str, ...]: ...

    @property
    def bridge_members(self) -> tuple[str, ...]: ...


def rdma_enable_steps(summary: RdmaVerdict, os_name: str, os_version: str) -> list[str]:
    """Steps a human follows to turn RDMA over Thunderbolt on for this node, or
    one sentence saying why it cannot be done here."""
    if os_name.strip().lower() not in _MAC_NAMES:
        return [
            f"This node runs {os_name or 'an unknown OS'}, not macOS: RDMA over Thunderbolt "
            "exists only on Macs with macOS 26.2 or later."
        ]
    version = _version_tuple(os_version)
    if version is not None and version < MIN_RDMA_MACOS:
        return [
            f"This Mac runs macOS {os_version}; RDMA over Thunderbolt needs macOS 26.2 "
            "or later. Update macOS first."
        ]
    bridge = [_BRIDGE_STEP] if summary.bridge_members else []
    if summary.usable:
        return [f"RDMA is already enabled ({', '.join(summary.devices)}).", *bridge]
    steps = [] if version else ["Check that this Mac runs macOS 26.2 or later."]
    return [
        *steps,
        "Shut the Mac down, then press and hold the power button until "
        "'Loading startup options' appears; choose Options, then Continue, to start recoveryOS.",
        "In recoveryOS choose Utilities > Terminal from the menu bar.",
        "Run: rdma_ctl enable",
        "Restart the Mac (Apple menu > Restart).",
        "Back in macOS, check: `rdma_ctl status` prints 'enabled' and `ibv_devices` "
        "lists rdma_enX devices.",
        "Do the same on every Mac it is cabled to: a port becomes PORT_ACTIVE only when "
        "both ends have RDMA enabled.",
        *bridge,
    ]
