"""macOS Thunderbolt probe: system_profiler SPThunderboltDataType, as JSON or as text."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from worker.shared.probes.common import (
    ProbeParseError,
    int_or_none,
    json_number,
    json_object,
    probe_parser,
)

# The XDomain service a Mac with RDMA enabled advertises to its Thunderbolt peer
# (`unknown_xd_service` in JSON, "Service Key: rdma" in the text form).
RDMA_XDOMAIN_PROTOCOL_ID = 64087


@dataclass(frozen=True)
class ThunderboltItem:
    """Something on the far side of a Thunderbolt port. A Mac has its own domain
    UUID; drives and docks do not, and must never be taken for a peer."""

    name: str
    model: str | None = None
    vendor: str | None = None
    domain_uuid: str | None = None
    receptacle: int | None = None
    link_speed: str | None = None
    protocol_ids: tuple[int, ...] = ()
    rdma_service: bool = False
    depth: int = 0

    @property
    def is_peer(self) -> bool:
        return self.domain_uuid is not None


@dataclass(frozen=True)
class ThunderboltBus:
    """One bus = one receptacle of this Mac; `items` flattened (hub children at depth 1+)."""

    bus: int | None
    receptacle: int | None
    speed: str | None
    link_status: str | None
    connected: bool
    domain_uuid: str | None = None
    device_name: str | None = None
    items: tuple[ThunderboltItem, ...] = ()

    @property
    def link_gbps(self) -> float | None:
        """The negotiated speed; None for an idle port ("Up to 120 Gb/s")."""
        return _link_gbps(self.speed)

    @property
    def peers(self) -> tuple[ThunderboltItem, ...]:
        return tuple(i for i in self.items if i.is_peer)

    @property
    def devices(self) -> tuple[ThunderboltItem, ...]:
        return tuple(i for i in self.items if not i.is_peer)


@dataclass(frozen=True)
class ThunderboltReport:
    buses: tuple[ThunderboltBus, ...]

    @property
    def peers(self) -> tuple[ThunderboltItem, ...]:
        return tuple(p for b in self.buses for p in b.peers)

    @property
    def devices(self) -> tuple[ThunderboltItem, ...]:
        return tuple(d for b in self.buses for d in b.devices)


def _link_gbps(speed: str | None) -> float | None:
    m = re.fullmatch(r"\s*([\d.]+)\s*Gb/s\s*", speed or "")
    return float(m.group(1)) if m else None


def _bus_number(name: str) -> int | None:
    m = re.search(r"bus[_ ](\d+)$", name, re.I)
    return int(m.group(1)) if m else None


def _tb_services(services: Any) -> tuple[tuple[int, ...], bool]:
    ids = tuple(
        int(s["protocol_id_key"])
        for s in services or ()
        if isinstance(s, dict) and json_number(s.get("protocol_id_key")) is not None
    )
    return ids, RDMA_XDOMAIN_PROTOCOL_ID in ids


def _tb_json_items(raw: Any, receptacle: int | None, depth: int) -> list[ThunderboltItem]:
    """Walk `_items` recursively: behind a transparent hub the peer sits one level deeper."""
    out: list[ThunderboltItem] = []
    for entry in raw or ():
        if not isinstance(entry, dict):
            raise ProbeParseError("system_profiler SPThunderboltDataType", "item is not an object")
        ids, rdma = _tb_services(entry.get("services_title"))
        upstream = entry.get("receptacle_upstream_ambiguous_tag") or {}
        out.append(
            ThunderboltItem(
                name=str(entry.get("_name", "")),
                model=entry.get("device_name_key"),
                vendor=entry.get("vendor_name_key"),
                domain_uuid=entry.get("domain_uuid_key"),
                receptacle=receptacle,
                link_speed=upstream.get("current_speed_key"),
                protocol_ids=ids,
                rdma_service=rdma,
                depth=depth,
            )
        )
        out.extend(_tb_json_items(entry.get("_items"), receptacle, depth + 1))
    return out


def _tb_json_bus(raw: Any) -> ThunderboltBus:
    if not isinstance(raw, dict):
        raise ProbeParseError("system_profiler SPThunderboltDataType", "bus is not an object")
    port = raw.get("receptacle_1_tag") or {}
    receptacle = int_or_none(port.get("receptacle_id_key"))
    return ThunderboltBus(
        bus=_bus_number(str(raw.get("_name", ""))),
        receptacle=receptacle,
        speed=port.get("current_speed_key"),
        link_status=port.get("link_status_key"),
        connected=port.get("receptacle_status_key") == "receptacle_connected",
        domain_uuid=raw.get("domain_uuid_key"),
        device_name=raw.get("device_name_key"),
        items=tuple(_tb_json_items(raw.get("_items"), receptacle, 0)),
    )


@probe_parser("system_profiler SPThunderboltDataType")
def parse_thunderbolt_json(text: str) -> ThunderboltReport:
    """`system_profiler SPThunderboltDataType -json`: buses in printed order."""
    doc = json_object(text, "system_profiler SPThunderboltDataType")
    buses = doc.get("SPThunderboltDataType") if isinstance(doc, dict) else None
    if not isinstance(buses, list):
        raise ProbeParseError("system_profiler SPThunderboltDataType", "no SPThunderboltDataType")
    return ThunderboltReport(buses=tuple(_tb_json_bus(b) for b in buses))


_TB_TEXT_BUS = re.compile(r"^\s*Thunderbolt(?:/USB4)? Bus (\d+):\s*$")
_TB_TEXT_KV = re.compile(r"^(\s*)([^:]+?):\s*(.*?)\s*$")
_TB_TEXT_FIELDS = {
    "Vendor Name": "vendor",
    "Device Name": "model",
    "Domain UUID": "domain_uuid",
    "Status": "status",
    "Link Status": "link_status",
    "Speed": "speed",
    "Receptacle": "receptacle",
}


@dataclass
class _TextNode:
    """Mutable builder for the text parser (a bus, or an item on it)."""

    name: str
    indent: int
    depth: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    protocol_ids: list[int] = field(default_factory=list)
    rdma: bool = False
    items: list[_TextNode] = field(default_factory=list)


def _tb_text_bus(bus: _TextNode) -> ThunderboltBus:
    f = bus.fields
    receptacle = int_or_none(f.get("receptacle"))
    items = tuple(
        ThunderboltItem(
            name=i.name,
            model=i.fields.get("model"),
            vendor=i.fields.get("vendor"),
            domain_uuid=i.fields.get("domain_uuid"),
            receptacle=receptacle,
            link_speed=i.fields.get("speed"),
            protocol_ids=tuple(i.protocol_ids),
            rdma_service=i.rdma or RDMA_XDOMAIN_PROTOCOL_ID in i.protocol_ids,
            depth=i.depth,
        )
        for i in bus.items
    )
    return ThunderboltBus(
        bus=_bus_number(bus.name),
        receptacle=receptacle,
        speed=f.get("speed"),
        link_status=f.get("link_status"),
        connected=f.get("status", "").lower() == "device connected",
        domain_uuid=f.get("domain_uuid"),
        device_name=f.get("model"),
        items=items,
    )


class _TbTextParser:
    """Indentation-driven walk; a heading that is neither "Port…" nor "Services"
    (nor inside Services) starts a connected item. A cut-off paste just ends early."""

    def __init__(self) -> None:
        self.buses: list[_TextNode] = []
        self.stack: list[_TextNode] = []
        self.section: tuple[str, int] | None = None

    def feed(self, line: str) -> None:
        bus = _TB_TEXT_BUS.match(line)
        if bus:
            self.buses.append(_TextNode(name=f"bus {bus.group(1)}", indent=-1))
            self.stack, self.section = [], None
            return
        m = _TB_TEXT_KV.match(line)
        if not self.buses:
            if m and m.group(2).strip() in ("Thunderbolt/USB4", "Thunderbolt") and not m.group(3):
                return
            raise ProbeParseError("system_profiler SPThunderboltDataType", "no bus heading")
        if m:
            self._pair(len(m.group(1)), m.group(2).strip(), m.group(3))

    def _pair(self, indent: int, key: str, value: str) -> None:
        if self.section and indent <= self.section[1]:
            self.section = None
        while self.stack and indent <= self.stack[-1].indent:
            self.stack.pop()
        target = self.stack[-1] if self.stack else self.buses[-1]
        if self.section and self.section[0] == "services":
            self._service(target, key, value)
        elif not value:
            self._heading(indent, key)
        elif key in _TB_TEXT_FIELDS:
            target.fields[_TB_TEXT_FIELDS[key]] = value

    def _heading(self, indent: int, key: str) -> None:
        if key == "Services":
            self.section = ("services", indent)
        elif key.startswith("Port"):
            self.section = ("port", indent)
        else:
            item = _TextNode(name=key, indent=indent, depth=len(self.stack))
            self.buses[-1].items.append(item)
            self.stack.append(item)

    @staticmethod
    def _service(target: _TextNode, key: str, value: str) -> None:
        if key == "Protocol ID" and value.isdigit():
            target.protocol_ids.append(int(value))
        elif key == "Service Key" and value.lower() == "rdma":
            target.rdma = True


@probe_parser("system_profiler SPThunderboltDataType")
def parse_thunderbolt_text(text: str) -> ThunderboltReport:
    """Plain-text `system_profiler SPThunderboltDataType`; a truncated paste yields
    whatever buses and items were complete enough to read."""
    parser = _TbTextParser()
    for line in text.splitlines():
        if line.strip():
            parser.feed(line)
    if not parser.buses:
        raise ProbeParseError("system_profiler SPThunderboltDataType", "no bus found")
    return ThunderboltReport(buses=tuple(_tb_text_bus(b) for b in parser.buses))
