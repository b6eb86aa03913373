"""The kind of link between two nodes, from both ends' addresses and interfaces (the
same on either platform)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from worker.shared.probes.common import Interface
from worker.shared.probes.macos.network import HardwarePort

LinkKind = Literal["thunderbolt", "ethernet", "wifi", "loopback", "unknown"]
LINK_KIND_LABELS: dict[str, str] = {
    "thunderbolt": "Thunderbolt bridge",
    "ethernet": "Ethernet",
    "wifi": "Wi-Fi",
    "loopback": "loopback",
    "unknown": "unknown link",
}


@dataclass(frozen=True)
class LinkEnd:
    """What an agent knows of the interface its bind address sits on."""

    address: str
    interface: str | None = None
    port: str | None = None  # macOS hardware port label ("Thunderbolt Bridge", "Wi-Fi", ...)
    prefix: int | None = None  # the address's IPv4 prefix length on that interface

    @classmethod
    def from_facts(cls, raw: Any) -> LinkEnd | None:
        """From an agent's `facts["link_end"]` (a plain dict on the wire)."""
        if not isinstance(raw, Mapping) or not isinstance(raw.get("address"), str):
            return None
        prefix = raw.get("prefix")
        return cls(
            address=raw["address"],
            interface=raw.get("interface") if isinstance(raw.get("interface"), str) else None,
            port=raw.get("port") if isinstance(raw.get("port"), str) else None,
            prefix=prefix if isinstance(prefix, int) and not isinstance(prefix, bool) else None,
        )


def link_end_from(
    address: str, interfaces: Mapping[str, Interface], ports: Sequence[HardwarePort] = ()
) -> LinkEnd:
    """The end an address makes, from parsed `ifconfig` (or `ip -j addr`) and
    `networksetup -listallhardwareports` output."""
    for iface in interfaces.values():
        if address in iface.ipv4:
            cidr = next((c for c in iface.ipv4_cidrs if c.split("/")[0] == address), None)
            prefix = int(cidr.split("/")[1]) if cidr and "/" in cidr else None
            label = next((p.port for p in ports if p.device == iface.name), None)
            return LinkEnd(address, iface.name, label, prefix)
    return LinkEnd(address)


def _is_loopback_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def end_kind(end: LinkEnd) -> LinkKind:
    """One end's kind. macOS names its ports (`networksetup`): "Thunderbolt
    Bridge" and "Thunderbolt N" carry IP over the cable, while "Thunderbolt
    Ethernet Slot N" is a dock's NIC (Ethernet). Without a label (Linux), the
    interface name says it: wl* Wi-Fi, thunderbolt* IP over Thunderbolt."""
    if _is_loopback_address(end.address):
        return "loopback"
    if not end.interface:
        return "unknown"
    label = (end.port or "").strip()
    if label:
        if label == "Thunderbolt Bridge" or re.fullmatch(r"Thunderbolt \d+", label):
            return "thunderbolt"
        if label in ("Wi-Fi", "AirPort"):
            return "wifi"
        return "ethernet"
    name = end.interface
    if name.startswith(("wl", "wlan")):
        return "wifi"
    if name.startswith("thunderbolt"):
        return "thunderbolt"
    if name == "lo" or name.startswith("lo0"):
        return "loopback"
    return "ethernet"


def _same_subnet(a: LinkEnd, b: LinkEnd) -> bool | None:
    if a.prefix is None or b.prefix is None:
        return None
    try:
        na = ipaddress.ip_network(f"{a.address}/{a.prefix}", strict=False)
        nb = ipaddress.ip_network(f"{b.address}/{b.prefix}", strict=False)
    except ValueError:
        return None
    return na == nb


def pair_link_kind(a: LinkEnd | None, b: LinkEnd | None) -> LinkKind:
    """The kind of the link between two agents, from both ends.

    A link is as slow as its slower end: Wi-Fi at either end makes it Wi-Fi. A
    Thunderbolt cable joins two ends on one subnet; two Thunderbolt ends on
    different subnets are routed through something else, so are not called a
    bridge. Both on loopback is loopback (the simulated cluster).
    """
    if a is None or b is None:
        return "unknown"
    ka, kb = end_kind(a), end_kind(b)
    if ka == kb == "loopback":
        return "loopback"
    if "loopback" in (ka, kb) or "unknown" in (ka, kb):
        return "wifi" if "wifi" in (ka, kb) else "unknown"
    if "wifi" in (ka, kb):
        return "wifi"
    if ka == kb == "thunderbolt":
        return "thunderbolt" if _same_subnet(a, b) is not False else "ethernet"
    return "ethernet"
