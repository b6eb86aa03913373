"""macOS network probes: ifconfig, networksetup -listallhardwareports, and which
interface is which Thunderbolt port (the peers each one reaches)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.shared.probes.common import Interface, ProbeParseError, probe_parser
from worker.shared.probes.macos.rdma import IbvDevice, IbvPort
from worker.shared.probes.macos.thunderbolt import ThunderboltItem, ThunderboltReport

_IFC_HEAD = re.compile(r"^(\S+?): flags=[0-9a-fA-F]+<([^>]*)>(?:.*?\bmtu (\d+))?")


def _netmask_prefix(mask: str) -> int:
    if mask.startswith("0x"):
        return bin(int(mask, 16)).count("1")
    return sum(bin(int(part)).count("1") for part in mask.split("."))


def _ifc_body(iface: dict[str, Any], line: str) -> None:
    words = line.split()
    if not words:
        return
    head = words[0]
    if head == "ether" and len(words) > 1:
        iface["ether"] = words[1]
    elif head == "inet" and len(words) > 1:
        iface["ipv4"].append(words[1])
        mask = words[words.index("netmask") + 1] if "netmask" in words[:-1] else None
        prefix = _netmask_prefix(mask) if mask else 32
        iface["ipv4_cidrs"].append(f"{words[1]}/{prefix}")
    elif head == "inet6" and len(words) > 1:
        iface["ipv6"].append(words[1].split("%")[0])
    elif head == "status:" and len(words) > 1:
        iface["status"] = words[1]
    elif head == "member:" and len(words) > 1:
        iface["members"].append(words[1])


def _ifc_new(m: re.Match[str]) -> dict[str, Any]:
    return {
        "name": m.group(1),
        "flags": tuple(f for f in m.group(2).split(",") if f),
        "mtu": int(m.group(3)) if m.group(3) else None,
        "ether": None,
        "ipv4": [],
        "ipv6": [],
        "status": None,
        "members": [],
        "ipv4_cidrs": [],
    }


def _ifc_freeze(raw: dict[str, Any]) -> Interface:
    lists = ("ipv4", "ipv6", "members", "ipv4_cidrs")
    fields: dict[str, Any] = {k: tuple(v) if k in lists else v for k, v in raw.items()}
    return Interface(**fields)


@probe_parser("ifconfig")
def parse_ifconfig(text: str) -> dict[str, Interface]:
    """Interfaces by name, in printed order. Lines Apple elided as "..." are skipped."""
    found: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if not line.strip() or line.strip() == "...":
            continue
        head = _IFC_HEAD.match(line)
        if head:
            current = found[head.group(1)] = _ifc_new(head)
        elif line[0].isspace() and current is not None:
            _ifc_body(current, line)
        else:
            raise ProbeParseError("ifconfig", f"unexpected line {line.strip()[:60]!r}")
    if not found:
        raise ProbeParseError("ifconfig", "no interface found")
    return {name: _ifc_freeze(raw) for name, raw in found.items()}


@dataclass(frozen=True)
class HardwarePort:
    port: str
    device: str
    ethernet_address: str | None = None


_NS_KEYS = {"Hardware Port": "port", "Device": "device", "Ethernet Address": "ethernet_address"}


def _ns_port(block: dict[str, str]) -> HardwarePort:
    if "device" not in block:
        raise ProbeParseError("networksetup", f"port {block.get('port')!r} has no Device line")
    mac = block.get("ethernet_address")
    return HardwarePort(
        port=block["port"],
        device=block["device"],
        ethernet_address=None if mac in (None, "", "N/A") else mac,
    )


@probe_parser("networksetup")
def parse_networksetup_ports(text: str) -> tuple[HardwarePort, ...]:
    """`networksetup -listallhardwareports`, in printed order; the trailing
    "VLAN Configurations" section is ignored."""
    blocks: list[dict[str, str]] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip() not in _NS_KEYS:
            continue
        if key.strip() == "Hardware Port":
            blocks.append({})
        if not blocks:
            raise ProbeParseError("networksetup", f"{key.strip()!r} before any 'Hardware Port:'")
        blocks[-1][_NS_KEYS[key.strip()]] = value.strip()
    if not blocks:
        raise ProbeParseError("networksetup", "no 'Hardware Port:' line")
    return tuple(_ns_port(b) for b in blocks)


def thunderbolt_ports(ports: Sequence[HardwarePort]) -> dict[int, str]:
    """Receptacle number N -> interface for hardware ports named exactly
    "Thunderbolt N". The map is not in ascending order (M5 Max MBP: 1/2/3 =
    en1/en6/en2), and "Thunderbolt Ethernet Slot N" is a dock's NIC and
    "Thunderbolt Bridge" the bridge, neither a peer link."""
    out: dict[int, str] = {}
    for p in ports:
        m = re.fullmatch(r"Thunderbolt (\d+)", p.port.strip())
        if m:
            out[int(m.group(1))] = p.device
    return out


@dataclass(frozen=True)
class PeerLink:
    """A cabled peer Mac, joined to the interface and RDMA device of its port."""

    receptacle: int | None
    interface: str | None
    rdma_device: str | None
    link_gbps: float | None
    peer: ThunderboltItem


def peer_links(report: ThunderboltReport, ports: Sequence[HardwarePort]) -> tuple[PeerLink, ...]:
    """receptacle N <-> "Thunderbolt N" <-> enX <-> rdma_enX, for every peer Mac."""
    by_receptacle = thunderbolt_ports(ports)
    links = []
    for bus in report.buses:
        iface = by_receptacle.get(bus.receptacle) if bus.receptacle is not None else None
        for peer in bus.peers:
            rdma = f"rdma_{iface}" if iface else None
            links.append(PeerLink(bus.receptacle, iface, rdma, bus.link_gbps, peer))
    return tuple(links)


@dataclass(frozen=True)
class ThunderboltPort:
    """One Thunderbolt port of this Mac as MLX's JACCL needs it: the port's own domain
    UUID (each bus has one), its interface and RDMA device, that device's port state,
    and the domain UUID of the Mac at the other end of its cable (None: nothing there,
    or a drive or dock, which has no domain UUID). Another Mac's port whose peer UUID
    is one of this Mac's own UUIDs is cabled to this Mac: that is how the operator
    learns which device reaches which node (as `mlx.distributed_config` and exo do)."""

    receptacle: int
    domain_uuid: str | None = None
    interface: str | None = None  # enX: networksetup's "Thunderbolt N" hardware port
    rdma_device: str | None = None  # rdma_enX, when ibv_devices lists it
    state: str | None = None  # ibv_devinfo's port state (PORT_ACTIVE, PORT_DOWN), if probed
    peer_uuid: str | None = None
    peer_model: str | None = None  # the peer's model identifier ("Mac15,14")
    link_gbps: float | None = None
    # The interface's own IPv4 address; "" when ifconfig lists it without one (JACCL
    # then finds no IPv4-mapped GID on the device: MLX PR #4191); None when unknown.
    ipv4: str | None = None

    @property
    def active(self) -> bool:
        return self.state == "PORT_ACTIVE"


def link_signal(
    ifconfig: Mapping[str, Interface],
    hardware: Sequence[HardwarePort],
    ports: Sequence[IbvPort],
) -> tuple[Any, ...]:
    """What changes, in the cheap probes' words, when a Thunderbolt cable is plugged
    in or pulled or a port goes up or down: each interface's link status, addresses and
    bridge members, the hardware port list, each RDMA port's state. While it is the
    same, the slow Thunderbolt bus listing (`system_profiler`, seconds on a Mac) would
    say what it said last time."""
    return (
        tuple(sorted((n, i.status, i.ipv4, i.members) for n, i in ifconfig.items())),
        tuple(hardware),
        tuple(sorted((p.device, p.port, p.state or "") for p in ports)),
    )


def thunderbolt_port_map(
    report: ThunderboltReport,
    ports: Sequence[HardwarePort],
    ibv_devices: Sequence[IbvDevice] = (),
    ibv_ports: Sequence[IbvPort] = (),
    interfaces: Mapping[str, Interface] | None = None,
) -> tuple[ThunderboltPort, ...]:
    """Every receptacle of this Mac, joined by its number, never by position: receptacle
    N <-> networksetup "Thunderbolt N" <-> enX <-> rdma_enX (listed by ibv_devices) <->
    that device's ibv_devinfo state <-> the interface's IPv4 in `interfaces` (ifconfig).
    None of these lists is in port order (M5 Max MBP:
    Thunderbolt 1/2/3 = en1/en6/en2; M3 Ultra lists rdma_en5 before rdma_en4). The peer
    is the first item on the bus with a domain UUID, a hub's children included."""
    by_receptacle = thunderbolt_ports(ports)
    listed = {d.name for d in ibv_devices}
    states = {p.device: p.state for p in ibv_ports}
    out: dict[int, ThunderboltPort] = {}
    for bus in report.buses:
        if bus.receptacle is None or bus.receptacle in out:
            continue
        iface = by_receptacle.get(bus.receptacle)
        device = f"rdma_{iface}" if iface and f"rdma_{iface}" in listed else None
        peer = next(iter(bus.peers), None)
        seen = (interfaces or {}).get(iface) if iface else None
        out[bus.receptacle] = ThunderboltPort(
            receptacle=bus.receptacle,
            domain_uuid=bus.domain_uuid.upper() if bus.domain_uuid else None,
            interface=iface,
            rdma_device=device,
            state=states.get(device) if device else None,
            peer_uuid=peer.domain_uuid.upper() if peer and peer.domain_uuid else None,
            peer_model=peer.model if peer else None,
            link_gbps=bus.link_gbps,
            ipv4=None if seen is None else next(iter(seen.ipv4), ""),
        )
    return tuple(out[k] for k in sorted(out))
