"""Linux probes: ip -j addr, /proc/meminfo, /etc/os-release, memory pressure (PSI) and
the RAPL energy counters."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.shared.probes.common import Interface, ProbeParseError, json_object, probe_parser

# ---------------------------------------------------------------------------
# ip -j addr, /proc/meminfo, /etc/os-release
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


@probe_parser("ip -j addr")
def parse_ip_addr_json(text: str) -> dict[str, Interface]:
    """`ip -j addr` as Interfaces by name; a bridge's members are the
    interfaces whose `master` names it."""
    doc = json_object(text, "ip -j addr")
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


@probe_parser("/proc/meminfo")
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


@probe_parser("os-release")
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
# PSI and RAPL (memory pressure and power)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Psi:
    """Linux pressure stall information: percent of wall time some (or all)
    tasks waited for memory, averaged over 10 and 60 seconds."""

    some_avg10: float
    some_avg60: float
    full_avg10: float | None = None
    full_avg60: float | None = None


_PSI_LINE = re.compile(r"^(some|full)\s+avg10=([\d.]+)\s+avg60=([\d.]+)", re.M)


@probe_parser("/proc/pressure/memory")
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
