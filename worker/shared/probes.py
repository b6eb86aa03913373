"""Pure parsers of probe output (macOS and Linux).

Nothing here runs a command or touches a file: callers (the agent, provision.py)
run the probe and hand the text in, so every parser can be tested on recorded
output (tests/fixtures/macos/). Every parser raises exactly one exception type,
`ProbeParseError`, whose message names the probe, so a caller can catch one thing
and show the operator which probe printed something unexpected.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar

__all__ = [
    "LINK_KIND_LABELS",
    "RDMA_XDOMAIN_PROTOCOL_ID",
    "HardwareInfo",
    "HardwarePort",
    "IbvDevice",
    "IbvPort",
    "Interface",
    "LinkEnd",
    "LinkKind",
    "MacmonSample",
    "MemInfo",
    "MemoryPressure",
    "OsRelease",
    "PeerLink",
    "PowermetricsSample",
    "ProbeParseError",
    "Psi",
    "RdmaStatus",
    "RdmaSummary",
    "RdmaVerdict",
    "ThunderboltBus",
    "ThunderboltItem",
    "ThunderboltPort",
    "ThunderboltReport",
    "VmStat",
    "end_kind",
    "link_end_from",
    "pair_link_kind",
    "parse_ibv_devices",
    "parse_ibv_devinfo",
    "parse_ifconfig",
    "parse_ip_addr_json",
    "parse_kern_boottime",
    "parse_macmon_line",
    "parse_memory_pressure",
    "parse_networksetup_ports",
    "parse_os_release",
    "parse_powermetrics",
    "parse_proc_meminfo",
    "parse_psi",
    "parse_rdma_ctl_status",
    "parse_sysctl_memsize",
    "parse_sysctl_value",
    "parse_system_profiler_hardware_json",
    "parse_system_profiler_hardware_text",
    "parse_thunderbolt_json",
    "parse_thunderbolt_text",
    "parse_vm_stat",
    "peer_links",
    "rapl_watts",
    "rdma_enable_steps",
    "rdma_summary",
    "thunderbolt_port_map",
    "thunderbolt_ports",
]

# The XDomain service a Mac with RDMA enabled advertises to its Thunderbolt peer
# (`unknown_xd_service` in JSON, "Service Key: rdma" in the text form).
RDMA_XDOMAIN_PROTOCOL_ID = 64087
MIN_RDMA_MACOS = (26, 2)

RdmaStatus = Literal["enabled", "disabled", "unknown"]

P = ParamSpec("P")
R = TypeVar("R")


class ProbeParseError(ValueError):
    """A probe printed something its parser cannot read."""

    def __init__(self, probe: str, detail: str) -> None:
        super().__init__(f"{probe}: {detail}")
        self.probe = probe


def _probe(
    name: str,
) -> Callable[[Callable[Concatenate[str, P], R]], Callable[Concatenate[str | bytes, P], R]]:
    """Normalise the input text and funnel every failure into ProbeParseError.

    Callers must be able to catch a single exception type; a stray KeyError from
    an odd JSON shape would otherwise crash the agent's telemetry loop.
    """

    def wrap(fn: Callable[Concatenate[str, P], R]) -> Callable[Concatenate[str | bytes, P], R]:
        @functools.wraps(fn)
        def inner(text: str | bytes, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            if not isinstance(text, str):
                raise ProbeParseError(name, f"expected text, got {type(text).__name__}")
            try:
                return fn(text, *args, **kwargs)
            except ProbeParseError:
                raise
            except Exception as exc:  # the contract: one exception type for callers
                raise ProbeParseError(name, f"{type(exc).__name__}: {exc}") from exc

        return inner

    return wrap


def _json_object(text: str, probe: str) -> Any:
    """json.loads, falling back to JSONC (comments, trailing commas) as in READMEs."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(_strip_jsonc(text))
    except json.JSONDecodeError as exc:
        raise ProbeParseError(probe, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None


# Strings are matched first so `//` or `,}` inside a string value survive. Two
# passes: a comment may sit between a trailing comma and its bracket.
_JSONC_COMMENT = re.compile(r'("(?:\\.|[^"\\])*")|//[^\n]*')
_JSONC_COMMA = re.compile(r'("(?:\\.|[^"\\])*")|,(\s*[}\]])')


def _strip_jsonc(text: str) -> str:
    text = _JSONC_COMMENT.sub(lambda m: m.group(1) or "", text)
    return _JSONC_COMMA.sub(lambda m: m.group(1) or m.group(2), text)


def _num(value: Any) -> float | None:
    """A JSON number as float; None for missing or non-numbers (bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


# ---------------------------------------------------------------------------
# sysctl, kern.boottime, memory_pressure, vm_stat
# ---------------------------------------------------------------------------

# `sysctl oid` prints "oid: value"; `sysctl -n oid` the bare value. OIDs always
# contain a dot, which keeps a value like "Apple M5" from being taken for one.
_SYSCTL_NAMED = re.compile(r"^[A-Za-z_]\w*(?:\.\w+)+(?::\s*| = )(.*)$")


def _sysctl_value(text: str, probe: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) != 1:
        raise ProbeParseError(probe, f"expected one value line, got {len(lines)}")
    m = _SYSCTL_NAMED.match(lines[0].strip())
    value = (m.group(1) if m else lines[0]).strip()
    if not value:
        raise ProbeParseError(probe, "empty value")
    return value


@_probe("sysctl")
def parse_sysctl_value(text: str) -> str:
    """The value of one `sysctl -n oid` (or `sysctl oid`) as a stripped string."""
    return _sysctl_value(text, "sysctl")


@_probe("sysctl hw.memsize")
def parse_sysctl_memsize(text: str) -> int:
    value = _sysctl_value(text, "sysctl hw.memsize")
    if not value.isdigit() or int(value) == 0:
        raise ProbeParseError("sysctl hw.memsize", f"not a byte count: {value[:40]!r}")
    return int(value)


_BOOTTIME = re.compile(r"\{\s*sec\s*=\s*(\d+),\s*usec\s*=\s*\d+\s*\}")


@_probe("sysctl kern.boottime")
def parse_kern_boottime(text: str) -> int:
    """Boot time as Unix epoch seconds (microseconds dropped)."""
    m = _BOOTTIME.search(text)
    if not m:
        raise ProbeParseError("sysctl kern.boottime", "no '{ sec = N, usec = N }' found")
    return int(m.group(1))


@dataclass(frozen=True)
class MemoryPressure:
    free_percent: int
    total_bytes: int | None = None
    page_size: int | None = None


_MP_FREE = re.compile(r"System-wide memory free percentage:\s*(\d+)\s*%")
_MP_TOTAL = re.compile(r"The system has (\d+) \((\d+) pages with a page size of (\d+)\)")


@_probe("memory_pressure")
def parse_memory_pressure(text: str) -> MemoryPressure:
    """`memory_pressure -Q` (or the full form): the system-wide free percentage."""
    m = _MP_FREE.search(text)
    if not m:
        raise ProbeParseError("memory_pressure", "no 'System-wide memory free percentage' line")
    total = _MP_TOTAL.search(text)
    return MemoryPressure(
        free_percent=int(m.group(1)),
        total_bytes=int(total.group(1)) if total else None,
        page_size=int(total.group(3)) if total else None,
    )


@dataclass(frozen=True)
class VmStat:
    """`vm_stat` counters, all in bytes. `anonymous`/`file_backed` are None on
    macOS versions that do not print them."""

    page_size: int
    free: int
    active: int
    inactive: int
    speculative: int
    wired: int
    compressed: int
    purgeable: int = 0
    anonymous: int | None = None
    file_backed: int | None = None

    @property
    def used_bytes(self) -> int:
        # Activity Monitor's "Memory Used" = App Memory + Wired + Compressed, with
        # App Memory = anonymous - purgeable. Without the anonymous counter fall
        # back to the common active + wired + compressed approximation.
        if self.anonymous is None:
            return self.active + self.wired + self.compressed
        return max(self.anonymous - self.purgeable, 0) + self.wired + self.compressed

    @property
    def available_bytes(self) -> int:
        # Free pages plus Activity Monitor's "Cached Files" (file-backed +
        # purgeable): what can be handed out without compressing or swapping.
        if self.file_backed is None:
            return self.free + self.inactive + self.speculative
        return self.free + self.file_backed + self.purgeable


_VM_PAGE = re.compile(r"page size of (\d+) bytes")
_VM_LINE = re.compile(r'^"?([^":]+)"?:\s+(\d+)\.?\s*$')
_VM_FIELDS = {
    "Pages free": "free",
    "Pages active": "active",
    "Pages inactive": "inactive",
    "Pages speculative": "speculative",
    "Pages wired down": "wired",
    "Pages occupied by compressor": "compressed",
    "Pages purgeable": "purgeable",
    "Anonymous pages": "anonymous",
    "File-backed pages": "file_backed",
}
_VM_REQUIRED = ("free", "active", "inactive", "wired")


@_probe("vm_stat")
def parse_vm_stat(text: str) -> VmStat:
    page = _VM_PAGE.search(text)
    if not page:
        raise ProbeParseError("vm_stat", "no '(page size of N bytes)' header")
    size = int(page.group(1))
    pages: dict[str, int] = {}
    for line in text.splitlines():
        m = _VM_LINE.match(line.strip())
        if m and m.group(1) in _VM_FIELDS:
            pages[_VM_FIELDS[m.group(1)]] = int(m.group(2))
    missing = [k for k in _VM_REQUIRED if k not in pages]
    if missing:
        raise ProbeParseError("vm_stat", f"missing counters: {', '.join(missing)}")
    in_bytes = {k: v * size for k, v in pages.items()}
    in_bytes.setdefault("speculative", 0)
    in_bytes.setdefault("compressed", 0)
    return VmStat(page_size=size, **in_bytes)


# ---------------------------------------------------------------------------
# rdma_ctl, ibv_devices, ibv_devinfo
# ---------------------------------------------------------------------------


@_probe("rdma_ctl status")
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


@_probe("ibv_devices")
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


@_probe("ibv_devinfo")
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
# system_profiler SPThunderboltDataType (JSON and text)
# ---------------------------------------------------------------------------


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
        if isinstance(s, dict) and _num(s.get("protocol_id_key")) is not None
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
    receptacle = _int_or_none(port.get("receptacle_id_key"))
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


@_probe("system_profiler SPThunderboltDataType")
def parse_thunderbolt_json(text: str) -> ThunderboltReport:
    """`system_profiler SPThunderboltDataType -json`: buses in printed order."""
    doc = _json_object(text, "system_profiler SPThunderboltDataType")
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
    receptacle = _int_or_none(f.get("receptacle"))
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


@_probe("system_profiler SPThunderboltDataType")
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


# ---------------------------------------------------------------------------
# ifconfig, networksetup, Thunderbolt port mapping
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Interface:
    """A network interface from `ifconfig` (macOS) or `ip -j addr` (Linux).

    `ipv4`/`ipv6` are bare addresses (IPv6 without its %scope: the interface name
    is the scope); `ipv4_cidrs` has the same IPv4 addresses with their prefix.
    `status` is as printed: "active"/"inactive" on macOS, the operstate on Linux.
    `members` are the bridge's member interfaces.
    """

    name: str
    flags: tuple[str, ...] = ()
    mtu: int | None = None
    ether: str | None = None
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    status: str | None = None
    members: tuple[str, ...] = ()
    ipv4_cidrs: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        return "UP" in self.flags

    @property
    def active(self) -> bool:
        return self.status in ("active", "up")


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


@_probe("ifconfig")
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


@_probe("networksetup")
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


# ---------------------------------------------------------------------------
# macmon, system_profiler SPHardwareDataType
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MacmonSample:
    """One `macmon pipe` sample. Usages are fractions 0..1 (macmon's "pct" keys
    are fractions too); powers in watts; memory in bytes; temperatures in °C."""

    ram_total: int
    ram_usage: int
    swap_total: int | None = None
    swap_usage: int | None = None
    timestamp: str | None = None
    cpu_usage: float | None = None
    ecpu_usage: float | None = None
    pcpu_usage: float | None = None
    gpu_usage: float | None = None
    ecpu_freq_mhz: float | None = None
    pcpu_freq_mhz: float | None = None
    gpu_freq_mhz: float | None = None
    cpu_power_w: float | None = None
    gpu_power_w: float | None = None
    ane_power_w: float | None = None
    ram_power_w: float | None = None
    all_power_w: float | None = None
    sys_power_w: float | None = None
    cpu_temp_c: float | None = None
    gpu_temp_c: float | None = None
    chip: str | None = None


def _macmon_cluster(doc: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    """(fraction, MHz): v0.7 has `name_usage` = [MHz, fraction]; v0.8 adds
    `name_scaled_ratio`/`name_freq_mhz`, preferred when present."""
    pair = doc.get(f"{name}_usage")
    old = pair if isinstance(pair, list) and len(pair) == 2 else [None, None]
    ratio = _num(doc.get(f"{name}_scaled_ratio"))
    mhz = _num(doc.get(f"{name}_freq_mhz"))
    return (
        ratio if ratio is not None else _num(old[1]),
        mhz if mhz is not None else _num(old[0]),
    )


def _macmon_doc(text: str) -> dict[str, Any]:
    try:
        doc = _json_object(text, "macmon")
    except ProbeParseError:
        # A pipe capture may hold several samples, one per line: take the newest.
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        if len(lines) < 2 or not lines[-1].startswith("{"):
            raise
        doc = _json_object(lines[-1], "macmon")
    if not isinstance(doc, dict):
        raise ProbeParseError("macmon", "sample is not a JSON object")
    return doc


@_probe("macmon")
def parse_macmon_line(text: str) -> MacmonSample:
    """A `macmon pipe` sample (v0.7 and v0.8 keys; README JSONC tolerated)."""
    doc = _macmon_doc(text)
    mem = doc.get("memory")
    if not isinstance(mem, dict) or _num(mem.get("ram_total")) is None:
        raise ProbeParseError("macmon", "no memory.ram_total in sample")
    found_temp, found_soc = doc.get("temp"), doc.get("soc")
    temp: dict[str, Any] = found_temp if isinstance(found_temp, dict) else {}
    soc: dict[str, Any] = found_soc if isinstance(found_soc, dict) else {}
    cpu = _num(doc.get("cpu_usage_pct"))
    ecpu, ecpu_mhz = _macmon_cluster(doc, "ecpu")
    pcpu, pcpu_mhz = _macmon_cluster(doc, "pcpu")
    gpu, gpu_mhz = _macmon_cluster(doc, "gpu")

    def opt_int(v: Any) -> int | None:
        n = _num(v)
        return int(n) if n is not None else None

    return MacmonSample(
        ram_total=int(mem["ram_total"]),
        ram_usage=opt_int(mem.get("ram_usage")) or 0,
        swap_total=opt_int(mem.get("swap_total")),
        swap_usage=opt_int(mem.get("swap_usage")),
        timestamp=doc.get("timestamp") if isinstance(doc.get("timestamp"), str) else None,
        cpu_usage=cpu if cpu is not None else _num(doc.get("cpu_scaled_ratio")),
        ecpu_usage=ecpu,
        pcpu_usage=pcpu,
        gpu_usage=gpu,
        ecpu_freq_mhz=ecpu_mhz,
        pcpu_freq_mhz=pcpu_mhz,
        gpu_freq_mhz=gpu_mhz,
        cpu_power_w=_num(doc.get("cpu_power")),
        gpu_power_w=_num(doc.get("gpu_power")),
        ane_power_w=_num(doc.get("ane_power")),
        ram_power_w=_num(doc.get("ram_power")),
        all_power_w=_num(doc.get("all_power")),
        sys_power_w=_num(doc.get("sys_power")),
        cpu_temp_c=_num(temp.get("cpu_temp_avg")),
        gpu_temp_c=_num(temp.get("gpu_temp_avg")),
        chip=soc.get("chip_name") if isinstance(soc.get("chip_name"), str) else None,
    )


@dataclass(frozen=True)
class HardwareInfo:
    """`system_profiler SPHardwareDataType`. `cores_performance`/`cores_efficiency`
    are the first and second core tier as listed (M5 names the first "Super")."""

    model_name: str | None
    model_id: str | None
    chip: str | None
    memory_bytes: int | None
    cores_total: int | None
    cores_performance: int | None = None
    cores_efficiency: int | None = None


_UNITS = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def _memory_bytes(value: Any) -> int | None:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", str(value or ""))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _proc_counts(value: Any) -> tuple[int | None, int | None, int | None]:
    # "proc 10:4:6:0" (total:first tier:second tier[:?]); M1..M4 print 3 fields.
    m = re.fullmatch(r"\s*proc (\d+)(?::(\d+):(\d+))?(?::\d+)*\s*", str(value or ""))
    if not m:
        return None, None, None
    total, perf, eff = m.groups()
    return int(total), _int_or_none(perf), _int_or_none(eff)


@_probe("system_profiler SPHardwareDataType")
def parse_system_profiler_hardware_json(text: str) -> HardwareInfo:
    doc = _json_object(text, "system_profiler SPHardwareDataType")
    entries = doc.get("SPHardwareDataType") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise ProbeParseError("system_profiler SPHardwareDataType", "no SPHardwareDataType entry")
    hw = entries[0]
    total, perf, eff = _proc_counts(hw.get("number_processors"))
    return HardwareInfo(
        model_name=hw.get("machine_name"),
        model_id=hw.get("machine_model"),
        chip=hw.get("chip_type"),
        memory_bytes=_memory_bytes(hw.get("physical_memory")),
        cores_total=total,
        cores_performance=perf,
        cores_efficiency=eff,
    )


_HW_CORES = re.compile(r"(\d+)(?:\s*\((\d+)\s+\w+\s+and\s+(\d+)\s+\w+\))?")


@_probe("system_profiler SPHardwareDataType")
def parse_system_profiler_hardware_text(text: str) -> HardwareInfo:
    """Plain-text form; stray stderr lines (system_profiler logs some) are ignored."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(": ")
        if sep:
            fields[key] = value.strip()
    if "Model Identifier" not in fields and "Chip" not in fields:
        raise ProbeParseError("system_profiler SPHardwareDataType", "no Model Identifier or Chip")
    cores = _HW_CORES.match(fields.get("Total Number of Cores", ""))
    total, perf, eff = cores.groups() if cores else (None, None, None)
    return HardwareInfo(
        model_name=fields.get("Model Name"),
        model_id=fields.get("Model Identifier"),
        chip=fields.get("Chip"),
        memory_bytes=_memory_bytes(fields.get("Memory")),
        cores_total=_int_or_none(total),
        cores_performance=_int_or_none(perf),
        cores_efficiency=_int_or_none(eff),
    )


# ---------------------------------------------------------------------------
# Linux: ip -j addr, /proc/meminfo, /etc/os-release
# ---------------------------------------------------------------------------


def _ip_interface(raw: dict[str, Any], members: tuple[str, ...]) -> Interface:
    addrs = [a for a in raw.get("addr_info") or () if isinstance(a, dict) and a.get("local")]
    v4 = [a for a in addrs if a.get("family") == "inet"]
    return Interface(
        name=str(raw["ifname"]),
        flags=tuple(str(f) for f in raw.get("flags") or ()),
        mtu=raw.get("mtu") if isinstance(raw.get("mtu"), int) else None,
        ether=raw.get("address") if raw.get("link_type") == "ether" else None,
        ipv4=tuple(str(a["local"]) for a in v4),
        ipv6=tuple(str(a["local"]) for a in addrs if a.get("family") == "inet6"),
        status=str(raw["operstate"]).lower() if raw.get("operstate") else None,
        members=members,
        ipv4_cidrs=tuple(f"{a['local']}/{a.get('prefixlen', 32)}" for a in v4),
    )


@_probe("ip -j addr")
def parse_ip_addr_json(text: str) -> dict[str, Interface]:
    """`ip -j addr` as Interfaces by name; a bridge's members are the
    interfaces whose `master` names it."""
    doc = _json_object(text, "ip -j addr")
    if not isinstance(doc, list) or not all(isinstance(d, dict) and "ifname" in d for d in doc):
        raise ProbeParseError("ip -j addr", "expected a list of interfaces with 'ifname'")

    def members(name: str) -> tuple[str, ...]:
        return tuple(str(d["ifname"]) for d in doc if d.get("master") == name)

    return {str(d["ifname"]): _ip_interface(d, members(str(d["ifname"]))) for d in doc}


@dataclass(frozen=True)
class MemInfo:
    total_bytes: int
    available_bytes: int
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None


_MEMINFO_LINE = re.compile(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s*kB)?\s*$")


@_probe("/proc/meminfo")
def parse_proc_meminfo(text: str) -> MemInfo:
    kib = {}
    for line in text.splitlines():
        m = _MEMINFO_LINE.match(line.strip())
        if m:
            kib[m.group(1)] = int(m.group(2)) * 1024
    if "MemTotal" not in kib:
        raise ProbeParseError("/proc/meminfo", "no MemTotal line")
    # Kernels before 3.14 lack MemAvailable; free + page cache is the old estimate.
    fallback = sum(kib.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
    return MemInfo(
        total_bytes=kib["MemTotal"],
        available_bytes=kib.get("MemAvailable", fallback),
        swap_total_bytes=kib.get("SwapTotal"),
        swap_free_bytes=kib.get("SwapFree"),
    )


@dataclass(frozen=True)
class OsRelease:
    id: str
    name: str | None = None
    version_id: str | None = None
    pretty_name: str | None = None
    id_like: tuple[str, ...] = ()


@_probe("os-release")
def parse_os_release(text: str) -> OsRelease:
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, raw = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ProbeParseError("os-release", f"not KEY=value: {line[:60]!r}")
        values[key] = " ".join(shlex.split(raw))
    if not values:
        raise ProbeParseError("os-release", "no KEY=value lines")
    return OsRelease(
        id=values.get("ID", "linux"),  # the os-release spec's default
        name=values.get("NAME"),
        version_id=values.get("VERSION_ID"),
        pretty_name=values.get("PRETTY_NAME"),
        id_like=tuple(values.get("ID_LIKE", "").split()),
    )


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


# ---------------------------------------------------------------------------
# powermetrics, Linux PSI and RAPL (power and memory pressure)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PowermetricsSample:
    """The watts in one `powermetrics --samplers cpu_power,gpu_power` sample."""

    cpu_w: float | None
    gpu_w: float | None
    ane_w: float | None
    combined_w: float | None


_PM_POWER = re.compile(r"^(CPU|GPU|ANE|Combined) Power[^:\n]*:\s*([\d.]+)\s*(mW|W)\b", re.M)


@_probe("powermetrics")
def parse_powermetrics(text: str) -> PowermetricsSample:
    """The first CPU/GPU/ANE/Combined power lines: the summary block. The GPU
    section repeats "GPU Power" and must not override the one Combined adds up."""
    found: dict[str, float] = {}
    for m in _PM_POWER.finditer(text):
        watts = float(m.group(2)) / (1000.0 if m.group(3) == "mW" else 1.0)
        found.setdefault(m.group(1), watts)
    if "CPU" not in found and "Combined" not in found:
        raise ProbeParseError("powermetrics", "no 'CPU Power' or 'Combined Power' line")
    combined = found.get("Combined")
    if combined is None:
        parts = [found.get(k) for k in ("CPU", "GPU", "ANE")]
        combined = sum(p for p in parts if p is not None)
    return PowermetricsSample(found.get("CPU"), found.get("GPU"), found.get("ANE"), combined)


@dataclass(frozen=True)
class Psi:
    """Linux pressure stall information: percent of wall time some (or all)
    tasks waited for memory, averaged over 10 and 60 seconds."""

    some_avg10: float
    some_avg60: float
    full_avg10: float | None = None
    full_avg60: float | None = None


_PSI_LINE = re.compile(r"^(some|full)\s+avg10=([\d.]+)\s+avg60=([\d.]+)", re.M)


@_probe("/proc/pressure/memory")
def parse_psi(text: str) -> Psi:
    lines = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in _PSI_LINE.finditer(text)}
    if "some" not in lines:
        raise ProbeParseError("/proc/pressure/memory", "no 'some avg10=… avg60=…' line")
    full = lines.get("full", (None, None))
    return Psi(lines["some"][0], lines["some"][1], full[0], full[1])


def rapl_watts(
    before: Mapping[str, int], after: Mapping[str, int], seconds: float, max_uj: Mapping[str, int]
) -> float | None:
    """Watts from two readings of RAPL zones' energy_uj, `seconds` apart.

    Counters wrap at max_energy_range_uj; a zone missing from either reading is
    left out, and with no zone or no time there is no figure (None, not 0).
    """
    if seconds <= 0:
        return None
    joules = 0.0
    counted = 0
    for zone, end in after.items():
        start = before.get(zone)
        if start is None:
            continue
        delta = end - start
        if delta < 0:
            delta += max_uj.get(zone, 0)
            if delta < 0:
                continue
        joules += delta / 1e6
        counted += 1
    return joules / seconds if counted else None


# ---------------------------------------------------------------------------
# The kind of link between two nodes, from both ends' addresses and interfaces
# ---------------------------------------------------------------------------

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
