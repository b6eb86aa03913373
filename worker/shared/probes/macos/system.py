"""macOS system probes: sysctl, kern.boottime, memory_pressure, vm_stat, macmon,
system_profiler SPHardwareDataType and powermetrics."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from worker.shared.probes.common import (
    ProbeParseError,
    int_or_none,
    json_number,
    json_object,
    probe_parser,
)

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


@probe_parser("sysctl")
def parse_sysctl_value(text: str) -> str:
    """The value of one `sysctl -n oid` (or `sysctl oid`) as a stripped string."""
    return _sysctl_value(text, "sysctl")


@probe_parser("sysctl hw.memsize")
def parse_sysctl_memsize(text: str) -> int:
    value = _sysctl_value(text, "sysctl hw.memsize")
    if not value.isdigit() or int(value) == 0:
        raise ProbeParseError("sysctl hw.memsize", f"not a byte count: {value[:40]!r}")
    return int(value)


_BOOTTIME = re.compile(r"\{\s*sec\s*=\s*(\d+),\s*usec\s*=\s*\d+\s*\}")


@probe_parser("sysctl kern.boottime")
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


@probe_parser("memory_pressure")
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


@probe_parser("vm_stat")
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
    ratio = json_number(doc.get(f"{name}_scaled_ratio"))
    mhz = json_number(doc.get(f"{name}_freq_mhz"))
    return (
        ratio if ratio is not None else json_number(old[1]),
        mhz if mhz is not None else json_number(old[0]),
    )


def _macmon_doc(text: str) -> dict[str, Any]:
    try:
        doc = json_object(text, "macmon")
    except ProbeParseError:
        # A pipe capture may hold several samples, one per line: take the newest.
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        if len(lines) < 2 or not lines[-1].startswith("{"):
            raise
        doc = json_object(lines[-1], "macmon")
    if not isinstance(doc, dict):
        raise ProbeParseError("macmon", "sample is not a JSON object")
    return doc


@probe_parser("macmon")
def parse_macmon_line(text: str) -> MacmonSample:
    """A `macmon pipe` sample (v0.7 and v0.8 keys; README JSONC tolerated)."""
    doc = _macmon_doc(text)
    mem = doc.get("memory")
    if not isinstance(mem, dict) or json_number(mem.get("ram_total")) is None:
        raise ProbeParseError("macmon", "no memory.ram_total in sample")
    found_temp, found_soc = doc.get("temp"), doc.get("soc")
    temp: dict[str, Any] = found_temp if isinstance(found_temp, dict) else {}
    soc: dict[str, Any] = found_soc if isinstance(found_soc, dict) else {}
    cpu = json_number(doc.get("cpu_usage_pct"))
    ecpu, ecpu_mhz = _macmon_cluster(doc, "ecpu")
    pcpu, pcpu_mhz = _macmon_cluster(doc, "pcpu")
    gpu, gpu_mhz = _macmon_cluster(doc, "gpu")

    def opt_int(v: Any) -> int | None:
        n = json_number(v)
        return int(n) if n is not None else None

    return MacmonSample(
        ram_total=int(mem["ram_total"]),
        ram_usage=opt_int(mem.get("ram_usage")) or 0,
        swap_total=opt_int(mem.get("swap_total")),
        swap_usage=opt_int(mem.get("swap_usage")),
        timestamp=doc.get("timestamp") if isinstance(doc.get("timestamp"), str) else None,
        cpu_usage=cpu if cpu is not None else json_number(doc.get("cpu_scaled_ratio")),
        ecpu_usage=ecpu,
        pcpu_usage=pcpu,
        gpu_usage=gpu,
        ecpu_freq_mhz=ecpu_mhz,
        pcpu_freq_mhz=pcpu_mhz,
        gpu_freq_mhz=gpu_mhz,
        cpu_power_w=json_number(doc.get("cpu_power")),
        gpu_power_w=json_number(doc.get("gpu_power")),
        ane_power_w=json_number(doc.get("ane_power")),
        ram_power_w=json_number(doc.get("ram_power")),
        all_power_w=json_number(doc.get("all_power")),
        sys_power_w=json_number(doc.get("sys_power")),
        cpu_temp_c=json_number(temp.get("cpu_temp_avg")),
        gpu_temp_c=json_number(temp.get("gpu_temp_avg")),
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
    return int(total), int_or_none(perf), int_or_none(eff)


@probe_parser("system_profiler SPHardwareDataType")
def parse_system_profiler_hardware_json(text: str) -> HardwareInfo:
    doc = json_object(text, "system_profiler SPHardwareDataType")
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


@probe_parser("system_profiler SPHardwareDataType")
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
        cores_total=int_or_none(total),
        cores_performance=int_or_none(perf),
        cores_efficiency=int_or_none(eff),
    )


# ---------------------------------------------------------------------------
# powermetrics (power)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PowermetricsSample:
    """The watts in one `powermetrics --samplers cpu_power,gpu_power` sample."""

    cpu_w: float | None
    gpu_w: float | None
    ane_w: float | None
    combined_w: float | None


_PM_POWER = re.compile(r"^(CPU|GPU|ANE|Combined) Power[^:\n]*:\s*([\d.]+)\s*(mW|W)\b", re.M)


@probe_parser("powermetrics")
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
