"""Pure parsers of probe output, by platform.

Nothing here runs a command or touches a file: callers (the agent, provision.py)
run the probe and hand the text in, so every parser can be tested on recorded
output (tests/fixtures/macos/). Every parser raises exactly one exception type,
`ProbeParseError`, whose message names the probe, so a caller can catch one thing
and show the operator which probe printed something unexpected.

- `common`: that exception, the decorator that funnels every failure into it, JSON
  (and JSONC) reading, and the network interface both platforms report;
- `macos/`: `system` (sysctl, memory_pressure, vm_stat, macmon, system_profiler
  hardware, powermetrics), `thunderbolt` (system_profiler SPThunderboltDataType),
  `network` (ifconfig, networksetup, which interface is which Thunderbolt port) and
  `rdma` (rdma_ctl, ibv_devices, ibv_devinfo, the RDMA summary and its steps);
- `linux`: ip -j addr, /proc/meminfo, /etc/os-release, PSI, RAPL;
- `links`: the kind of link between two nodes, from both ends.

Every public name is importable from here, `worker.shared.probes`, as before the split.
"""

from __future__ import annotations

from worker.shared.probes.common import (
    Interface,
    ProbeParseError,
)
from worker.shared.probes.links import (
    LINK_KIND_LABELS,
    LinkEnd,
    LinkKind,
    end_kind,
    link_end_from,
    pair_link_kind,
)
from worker.shared.probes.linux import (
    MemInfo,
    OsRelease,
    Psi,
    parse_ip_addr_json,
    parse_os_release,
    parse_proc_meminfo,
    parse_psi,
    rapl_watts,
)
from worker.shared.probes.macos.network import (
    HardwarePort,
    PeerLink,
    ThunderboltPort,
    link_signal,
    parse_ifconfig,
    parse_networksetup_ports,
    peer_links,
    thunderbolt_port_map,
    thunderbolt_ports,
)
from worker.shared.probes.macos.rdma import (
    MIN_RDMA_MACOS,
    IbvDevice,
    IbvPort,
    RdmaStatus,
    RdmaSummary,
    RdmaVerdict,
    parse_ibv_devices,
    parse_ibv_devinfo,
    parse_rdma_ctl_status,
    rdma_enable_steps,
    rdma_summary,
)
from worker.shared.probes.macos.system import (
    HardwareInfo,
    MacmonSample,
    MemoryPressure,
    PowermetricsSample,
    VmStat,
    parse_kern_boottime,
    parse_macmon_line,
    parse_memory_pressure,
    parse_powermetrics,
    parse_sysctl_memsize,
    parse_sysctl_value,
    parse_system_profiler_hardware_json,
    parse_system_profiler_hardware_text,
    parse_vm_stat,
)
from worker.shared.probes.macos.thunderbolt import (
    RDMA_XDOMAIN_PROTOCOL_ID,
    ThunderboltBus,
    ThunderboltItem,
    ThunderboltReport,
    parse_thunderbolt_json,
    parse_thunderbolt_text,
)

__all__ = [
    "LINK_KIND_LABELS",
    "MIN_RDMA_MACOS",
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
    "link_signal",
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
