"""Tests of worker.shared.probes on the real recorded macOS outputs in tests/fixtures/macos/.

Nobody on the team has a Mac, so these recordings are the only ground truth; the
values asserted below were read from the files themselves.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.fixture_paths import (
    DEVINFO_ACTIVE,
    DEVINFO_DOWN,
    DEVINFO_GID,
    HW_JSON,
    HW_TEXT,
    IBV_MBP,
    IBV_MINI,
    IBV_NONE,
    IBV_STUDIO,
    IFC_ALL,
    IFC_BRIDGE,
    IFC_EN2,
    IFC_EN8,
    IFC_NOADDR,
    IN_REPO,
    MACMON_M4_CUT,
    MACMON_V07_JSONC,
    MACMON_V07_JSONL,
    MACMON_V08_JSONC,
    MEMORY_PRESSURE,
    NS_EXO,
    NS_OSAURUS,
    RDMA_CTL,
    TB_MBP,
    TB_OFF,
    TB_ON,
    TB_STUDIO,
    TB_TEXT_NONE,
    TB_TEXT_PEER,
    macos_fixtures,
    read_fixture,
)
from worker.shared import probes
from worker.shared.probes import (
    RDMA_XDOMAIN_PROTOCOL_ID,
    HardwarePort,
    IbvDevice,
    IbvPort,
    Interface,
    ProbeParseError,
    ThunderboltReport,
    parse_ibv_devices,
    parse_ibv_devinfo,
    parse_ifconfig,
    parse_ip_addr_json,
    parse_kern_boottime,
    parse_macmon_line,
    parse_memory_pressure,
    parse_networksetup_ports,
    parse_os_release,
    parse_proc_meminfo,
    parse_rdma_ctl_status,
    parse_sysctl_memsize,
    parse_sysctl_value,
    parse_system_profiler_hardware_json,
    parse_system_profiler_hardware_text,
    parse_thunderbolt_json,
    parse_thunderbolt_text,
    parse_vm_stat,
    peer_links,
    rdma_enable_steps,
    rdma_summary,
    thunderbolt_ports,
)

FIXTURES = macos_fixtures()


def fx(name: str) -> str:
    return read_fixture(name)


# ---------------------------------------------------------------------------
# Every recorded file goes through its parser
# ---------------------------------------------------------------------------

# The parser for each file, chosen by the command at the start of its name.
_PARSER_BY_PREFIX: list[tuple[str, Callable[[str], Any]]] = [
    ("ibv_devices.", parse_ibv_devices),
    ("ibv_devinfo", parse_ibv_devinfo),
    ("ifconfig", parse_ifconfig),
    ("macmon_pipe", parse_macmon_line),
    ("memory_pressure", parse_memory_pressure),
    ("networksetup", parse_networksetup_ports),
    ("powermetrics", probes.parse_powermetrics),
    ("rdma_ctl_status", parse_rdma_ctl_status),
    ("sysctl_-n_kern.boottime", parse_kern_boottime),
    ("sysctl_-n_", parse_sysctl_value),
    ("system_profiler_SPHardwareDataType.json", parse_system_profiler_hardware_json),
    ("system_profiler_SPHardwareDataType.text", parse_system_profiler_hardware_text),
    ("system_profiler_SPThunderboltDataType.json", parse_thunderbolt_json),
    ("system_profiler_SPThunderboltDataType.text", parse_thunderbolt_text),
]

# The published copy is cut inside a JSON array: no parser can recover a sample.
_UNREADABLE = {MACMON_M4_CUT}


def _fixture_files() -> list[str]:
    if not FIXTURES.is_dir():
        return []
    return sorted(p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != "README.md")


def _parser_for(name: str) -> Callable[[str], Any]:
    for prefix, parser in _PARSER_BY_PREFIX:
        if name.startswith(prefix):
            return parser
    raise AssertionError(f"no parser registered for fixture {name}")


def test_fixture_folder_is_found() -> None:
    assert FIXTURES.is_dir(), (
        f"fixtures not found at {FIXTURES} (the repository carries them in {IN_REPO})"
    )
    assert len(_fixture_files()) >= 30


@pytest.mark.parametrize("name", _fixture_files())
def test_every_fixture_parses(name: str) -> None:
    parser = _parser_for(name)
    if name in _UNREADABLE:
        with pytest.raises(ProbeParseError):
            parser(fx(name))
        return
    assert parser(fx(name)) is not None


@pytest.mark.parametrize("name", _fixture_files())
def test_every_fixture_also_parses_as_bytes(name: str) -> None:
    # Agents hand over subprocess stdout as bytes; the parsers decode it.
    if name in _UNREADABLE:
        return
    parser = _parser_for(name)
    assert parser((FIXTURES / name).read_bytes()) == parser(fx(name))


# ---------------------------------------------------------------------------
# sysctl, memory_pressure, vm_stat
# ---------------------------------------------------------------------------


def test_sysctl_values_from_m5_macbook_pro() -> None:
    assert parse_sysctl_value(fx("sysctl_-n_hw.model.m5-macbookpro.voltry-fixture.txt")) == (
        "Mac17,2"
    )
    assert parse_sysctl_value(fx("sysctl_-n_hw.target.m5-macbookpro.voltry-fixture.txt")) == (
        "J704AP"
    )
    brand = fx("sysctl_-n_machdep.cpu.brand_string.m5-macbookpro.voltry-fixture.txt")
    assert parse_sysctl_value(brand) == "Apple M5"


def test_sysctl_named_form_and_memsize() -> None:
    # 25769803776 is the M5's memory as the voltry tests record it (24 GiB).
    assert parse_sysctl_memsize("25769803776\n") == 25769803776
    assert parse_sysctl_memsize("hw.memsize: 25769803776\n") == 25769803776
    assert parse_sysctl_value("hw.model: Mac15,14\n") == "Mac15,14"


def test_kern_boottime() -> None:
    text = fx("sysctl_-n_kern.boottime.m5-macbookpro.voltry-fixture.txt")
    assert parse_kern_boottime(text) == 1787929257
    assert parse_kern_boottime("kern.boottime: " + text) == 1787929257


def test_memory_pressure_m5() -> None:
    mp = parse_memory_pressure(fx(MEMORY_PRESSURE))
    assert mp.free_percent == 63
    assert mp.total_bytes == 25769803776
    assert mp.page_size == 16384


# A `vm_stat` printout in the real layout from a 16 GB Apple Silicon Mac (no
# vm_stat capture is in the fixtures folder).
VM_STAT_16GB = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                4518.
Pages active:                            194947.
Pages inactive:                          191193.
Pages speculative:                         3014.
Pages throttled:                              0.
Pages wired down:                        159117.
Pages purgeable:                            630.
"Translation faults":                 574921966.
Pages copy-on-write:                   38671927.
Pages zero filled:                    320571840.
Pages reactivated:                     75978152.
Pages purged:                          16666917.
File-backed pages:                       141843.
Anonymous pages:                         247311.
Pages stored in compressor:             1022243.
Pages occupied by compressor:            454496.
Decompressions:                        73011127.
Compressions:                          92304380.
Pageins:                                7854456.
Pageouts:                                320741.
Swapins:                                 470789.
Swapouts:                                929703.
"""


def test_vm_stat_counters_and_activity_monitor_estimate() -> None:
    vm = parse_vm_stat(VM_STAT_16GB)
    page = 16384
    assert vm.page_size == page
    assert vm.free == 4518 * page
    assert vm.active == 194947 * page
    assert vm.inactive == 191193 * page
    assert vm.speculative == 3014 * page
    assert vm.wired == 159117 * page
    assert vm.compressed == 454496 * page
    assert vm.used_bytes == (247311 - 630 + 159117 + 454496) * page
    assert vm.available_bytes == (4518 + 141843 + 630) * page
    # The two estimates split every page the queues account for.
    queues = vm.free + vm.active + vm.inactive + vm.speculative + vm.wired + vm.compressed
    assert vm.used_bytes + vm.available_bytes == queues


def test_vm_stat_without_anonymous_counter_falls_back() -> None:
    text = "\n".join(VM_STAT_16GB.splitlines()[:8])
    vm = parse_vm_stat(text)
    assert vm.anonymous is None
    assert vm.used_bytes == (194947 + 159117) * 16384
    assert vm.available_bytes == (4518 + 191193 + 3014) * 16384


# ---------------------------------------------------------------------------
# rdma_ctl, ibv_devices, ibv_devinfo
# ---------------------------------------------------------------------------


def test_rdma_ctl_status() -> None:
    assert parse_rdma_ctl_status(fx(RDMA_CTL)) == "enabled"
    assert parse_rdma_ctl_status("disabled\n") == "disabled"
    assert parse_rdma_ctl_status("") == "unknown"
    reply = "rdma_ctl: This tool needs to be executed from Recovery OS.\n"
    assert parse_rdma_ctl_status(reply) == "unknown"


def test_ibv_devices_keeps_printed_order() -> None:
    studio = parse_ibv_devices(fx(IBV_STUDIO))
    assert [d.name for d in studio] == [
        "rdma_en2",
        "rdma_en3",
        "rdma_en5",
        "rdma_en4",
        "rdma_en6",
        "rdma_en7",
    ]
    assert studio[2] == IbvDevice("rdma_en5", "8396a9d9edbaac05")


def test_ibv_devices_other_recordings() -> None:
    mini = parse_ibv_devices(fx(IBV_MINI))  # tabs rendered as spaces by Apple's page
    assert mini == (
        IbvDevice("rdma_en2", "e0c5797d9c8fac05"),
        IbvDevice("rdma_en3", "e1c5797d9c8fac05"),
        IbvDevice("rdma_en4", "e2c5797d9c8fac05"),
    )
    mbp = parse_ibv_devices(fx(IBV_MBP))
    assert [d.name for d in mbp] == ["rdma_en1", "rdma_en6", "rdma_en2"]
    assert parse_ibv_devices(fx(IBV_NONE)) == ()


def test_ibv_devinfo_port_down_capture() -> None:
    ports = parse_ibv_devinfo(fx(DEVINFO_DOWN))
    assert [p.device for p in ports] == ["rdma_en1", "rdma_en6", "rdma_en2"]
    first = ports[0]
    assert first == IbvPort(
        device="rdma_en1",
        port=1,
        state="PORT_DOWN",
        active_mtu=4096,
        link_layer="Thunderbolt",
        transport="Thunderbolt (100)",
        node_guid="0000:0000:0000:0002",
        max_mtu=4096,
    )
    assert not any(p.active for p in ports)


def test_ibv_devinfo_apple_elided_excerpt() -> None:
    ports = parse_ibv_devinfo(fx(DEVINFO_ACTIVE))
    assert [(p.device, p.port, p.state) for p in ports] == [
        ("rdma_en2", 1, "PORT_ACTIVE"),
        ("rdma_en3", 1, "PORT_ACTIVE"),
        ("rdma_en4", 1, "PORT_ACTIVE"),
    ]
    assert all(p.active and p.active_mtu is None for p in ports)


def test_ibv_devinfo_rewrapped_gid_table() -> None:
    (port,) = parse_ibv_devinfo(fx(DEVINFO_GID))
    assert port.device == "rdma_en2"
    assert port.state == "PORT_ACTIVE"
    assert port.node_guid == "9093:3a23:2588:ac05"
    assert port.transport == "Thunderbolt (100)"
    assert port.active_width == "8X (4)"
    assert port.active_speed == "10.0 Gbps (4)"
    # GID[1] is the IPv4-mapped address JACCL needs: the en2 fixture's IPv4.
    assert port.gids == (
        "fe80::344d:4ff:feea:4e40",
        "::ffff:169.254.205.255",
        "fe80::1021:1bac:fe1:b5e3",
    )


def test_ibv_devinfo_no_devices() -> None:
    assert parse_ibv_devinfo("No IB devices found\n") == ()


# ---------------------------------------------------------------------------
# Thunderbolt
# ---------------------------------------------------------------------------


def test_thunderbolt_studio_drive_is_not_a_peer() -> None:
    report = parse_thunderbolt_json(fx(TB_STUDIO))
    assert [b.bus for b in report.buses] == [5, 4, 3, 2, 1, 0]
    assert [b.receptacle for b in report.buses] == [6, 5, 4, 3, 2, 1]
    drive_bus = report.buses[2]
    assert drive_bus.connected and drive_bus.link_gbps == 80.0
    (drive,) = drive_bus.items
    assert drive.name == "Envoy Ultra"
    assert drive.vendor == "Other World Computing"
    assert not drive.is_peer
    assert drive_bus.peers == ()
    assert report.devices == (drive,)


def test_thunderbolt_studio_peer_advertises_rdma() -> None:
    report = parse_thunderbolt_json(fx(TB_STUDIO))
    (peer,) = report.peers
    assert peer.name == "MacBook Pro"
    assert peer.model == "Mac17,7"
    assert peer.domain_uuid == "817DCFA4-B481-4100-80FC-91C7AA969F0B"
    assert peer.receptacle == 2
    assert peer.protocol_ids == (1, RDMA_XDOMAIN_PROTOCOL_ID)
    assert peer.rdma_service
    idle = report.buses[0]
    assert not idle.connected
    assert idle.speed == "Up to 120 Gb/s"
    assert idle.link_gbps is None
    assert idle.link_status == "0x100"


def test_thunderbolt_omlx_pair_is_reciprocal() -> None:
    studio = parse_thunderbolt_json(fx(TB_STUDIO))
    mbp = parse_thunderbolt_json(fx(TB_MBP))
    (studio_seen_from_mbp,) = mbp.peers
    assert studio_seen_from_mbp.model == "Mac15,14"
    assert studio_seen_from_mbp.receptacle == 1
    assert not studio_seen_from_mbp.rdma_service
    # Each side's peer domain UUID is the other side's own bus UUID.
    assert studio_seen_from_mbp.domain_uuid in {b.domain_uuid for b in studio.buses}
    assert studio.peers[0].domain_uuid in {b.domain_uuid for b in mbp.buses}


def test_thunderbolt_osaurus_pair_docks_and_service_asymmetry() -> None:
    off = parse_thunderbolt_json(fx(TB_OFF))
    on = parse_thunderbolt_json(fx(TB_ON))
    assert [d.name for d in off.devices] == ["SB-XTM5"]
    assert [d.name for d in on.devices] == ["TBU405Pro"]
    assert on.buses[0].link_gbps == 40.0
    assert off.buses[0].link_status == "0x4"
    (peer_of_off,) = off.peers
    (peer_of_on,) = on.peers
    assert peer_of_off.rdma_service and not peer_of_on.rdma_service
    assert peer_of_off.model == peer_of_on.model == "Mac17,6"
    assert peer_of_off.domain_uuid == on.buses[1].domain_uuid


def test_thunderbolt_json_finds_peer_behind_hub() -> None:
    doc = json.loads(fx(TB_MBP))
    bus = doc["SPThunderboltDataType"][2]
    hub = {"_name": "Fusiondock", "device_name_key": "Fusiondock", "_items": bus["_items"]}
    bus["_items"] = [hub]
    report = parse_thunderbolt_json(json.dumps(doc))
    assert [(i.name, i.depth, i.is_peer) for i in report.buses[2].items] == [
        ("Fusiondock", 0, False),
        ("Mac Studio", 1, True),
    ]
    assert report.peers[0].model == "Mac15,14"


def test_thunderbolt_text_no_peer() -> None:
    report = parse_thunderbolt_text(fx(TB_TEXT_NONE))
    assert [(b.bus, b.receptacle) for b in report.buses] == [(2, 3), (1, 2), (0, 1)]
    assert all(not b.connected and b.speed == "Up to 120 Gb/s" for b in report.buses)
    assert report.buses[0].domain_uuid == "3D589BC7-F32A-4054-BE1A-F8253AD4FE51"
    assert report.peers == ()


def test_thunderbolt_text_truncated_peer() -> None:
    report = parse_thunderbolt_text(fx(TB_TEXT_PEER))
    bus2 = report.buses[0]
    assert (bus2.bus, bus2.receptacle, bus2.link_gbps, bus2.connected) == (2, 3, 80.0, True)
    (peer,) = report.peers
    assert peer.name == "Mac Studio"
    assert peer.model == "Mac16,9"
    assert peer.domain_uuid == "88F10ACA-5CAA-4F5D-8361-03EED54ACB5A"
    assert peer.protocol_ids == (1, RDMA_XDOMAIN_PROTOCOL_ID)
    assert peer.rdma_service
    # The paste stops inside Bus 1: it is there, without its port fields.
    assert report.buses[1].bus == 1
    assert report.buses[1].receptacle is None


# ---------------------------------------------------------------------------
# ifconfig, networksetup
# ---------------------------------------------------------------------------


def test_ifconfig_full_listing_bridge_members() -> None:
    ifaces = parse_ifconfig(fx(IFC_ALL))
    assert list(ifaces)[:3] == ["lo0", "gif0", "stf0"]
    bridge = ifaces["bridge0"]
    assert bridge.members == ("en1", "en2", "en3")
    assert bridge.status == "inactive" and not bridge.active
    en1 = ifaces["en1"]
    assert "PROMISC" in en1.flags and en1.up
    assert en1.ether == "36:10:0f:92:66:40"
    assert ifaces["stf0"].flags == ()
    assert ifaces["lo0"].ipv6 == ("::1", "fe80::1")
    en0 = ifaces["en0"]
    assert en0.ipv4 == ("192.168.1.237",)
    assert en0.ipv4_cidrs == ("192.168.1.237/24",)
    assert en0.ipv6 == ("fe80::c3f:8342:b210:f73b",)
    assert ifaces["utun2"].mtu == 2000


def test_ifconfig_tb_port_with_own_addresses() -> None:
    en2 = parse_ifconfig(fx(IFC_EN2))["en2"]
    assert en2.ipv4 == ("169.254.205.255",)
    assert en2.ipv4_cidrs == ("169.254.205.255/16",)
    assert en2.ipv6 == ("fe80::1021:1bac:fe1:b5e3",)
    assert en2.ether == "36:4d:04:ea:4e:40"
    assert en2.active and en2.mtu == 1500


def test_ifconfig_other_recordings() -> None:
    en8 = parse_ifconfig(fx(IFC_EN8))["en8"]  # note the trailing space on the inet6 line
    assert en8.ipv4 == ("169.254.138.233",)
    assert en8.ipv6 == ("fe80::a0:2256:4d46:27ee",)
    down = parse_ifconfig(fx(IFC_NOADDR))
    assert list(down) == ["en2", "en3", "en4"]
    assert all(not i.up and i.ipv4 == () and i.status == "inactive" for i in down.values())
    bridge = parse_ifconfig(fx(IFC_BRIDGE))["bridge0"]
    assert bridge.members == ("en2", "en3", "en4")
    assert bridge.active


def test_networksetup_thunderbolt_mapping_not_ascending() -> None:
    for name in (NS_EXO, NS_OSAURUS):
        ports = parse_networksetup_ports(fx(name))
        mapping = thunderbolt_ports(ports)
        assert mapping == {1: "en1", 2: "en6", 3: "en2"}
        assert list(mapping.values()) == ["en1", "en6", "en2"]


def test_networksetup_dock_nics_are_not_peer_links() -> None:
    ports = parse_networksetup_ports(fx(NS_EXO))
    assert len(ports) == 9
    assert ports[3] == HardwarePort("Thunderbolt Ethernet Slot 0", "en10", "64:4b:f0:80:05:84")
    mapped = set(thunderbolt_ports(ports).values())
    assert not mapped & {"en10", "en11", "bridge0", "en16"}
    osaurus = parse_networksetup_ports(fx(NS_OSAURUS))
    assert osaurus[-1] == HardwarePort("Thunderbolt 3", "en2", "02:00:00:00:00:03")


def test_peer_links_join_receptacle_interface_and_rdma_device() -> None:
    report = parse_thunderbolt_json(fx(TB_OFF))
    ports = parse_networksetup_ports(fx(NS_OSAURUS))
    (link,) = peer_links(report, ports)
    assert (link.receptacle, link.interface, link.rdma_device) == (2, "en6", "rdma_en6")
    assert link.link_gbps == 80.0
    assert link.peer.model == "Mac17,6"
    devices = [d.name for d in parse_ibv_devices(fx(IBV_MBP))]
    assert link.rdma_device in devices


# ---------------------------------------------------------------------------
# macmon, system_profiler SPHardwareDataType
# ---------------------------------------------------------------------------


def test_macmon_v07_line() -> None:
    s = parse_macmon_line(fx(MACMON_V07_JSONL))
    assert s.ram_total == 25769803776
    assert s.ram_usage == 20985479168
    assert s.swap_usage == 2602434560
    assert s.cpu_usage == pytest.approx(0.036854)
    assert s.ecpu_usage == pytest.approx(0.082656614)
    assert s.ecpu_freq_mhz == 1181
    assert s.pcpu_freq_mhz == 1974
    assert s.gpu_usage == pytest.approx(0.021497859)
    assert s.sys_power_w == pytest.approx(5.876533)
    assert s.cpu_temp_c == pytest.approx(43.73614)
    assert s.timestamp == "2025-02-24T20:38:15.427569+00:00"
    # The README's commented form carries the same sample.
    assert parse_macmon_line(fx(MACMON_V07_JSONC)) == s


def test_macmon_v08_readme_example() -> None:
    s = parse_macmon_line(fx(MACMON_V08_JSONC))
    assert s.cpu_usage == pytest.approx(0.036854)  # cpu_scaled_ratio
    assert s.ecpu_freq_mhz == 1100
    assert s.pcpu_usage == pytest.approx(0.015181795)
    assert s.gpu_freq_mhz == 461
    assert s.ram_total == 25769803776
    assert s.gpu_temp_c == pytest.approx(36.95167)


def test_macmon_v08_keys_win_over_kept_v07_keys() -> None:
    # Real v0.8 output still carries the v0.7 keys; the cluster frequency differs.
    doc = json.loads(fx(MACMON_V07_JSONL))
    doc.update(ecpu_freq_mhz=1100, ecpu_scaled_ratio=0.5)
    s = parse_macmon_line(json.dumps(doc))
    assert (s.ecpu_freq_mhz, s.ecpu_usage) == (1100, 0.5)
    assert s.pcpu_freq_mhz == 1974


def test_macmon_several_lines_takes_last_and_truncated_raises() -> None:
    line = fx(MACMON_V07_JSONL).strip()
    newer = line.replace('"ram_usage":20985479168', '"ram_usage":1')
    assert parse_macmon_line(line + "\n" + newer + "\n").ram_usage == 1
    with pytest.raises(ProbeParseError, match="macmon"):
        parse_macmon_line(fx(MACMON_M4_CUT))


def test_macmon_m4_sample_once_complete() -> None:
    # Close the cut M4 sample to check the v0.7 keys macmon printed there.
    text = fx(MACMON_M4_CUT).rstrip().rstrip(",") + "]}}"
    s = parse_macmon_line(text)
    assert s.chip == "Apple M4"
    assert s.ram_total == 17179869184
    assert s.pcpu_freq_mhz == 3848
    assert s.cpu_usage is None  # no cpu_usage_pct in that sample


def test_hardware_json_m5() -> None:
    hw = parse_system_profiler_hardware_json(fx(HW_JSON))
    assert hw.chip == "Apple M5"
    assert hw.model_id == "Mac17,2"
    assert hw.model_name == "MacBook Pro"
    assert hw.memory_bytes == 24 * 2**30
    assert (hw.cores_total, hw.cores_performance, hw.cores_efficiency) == (10, 4, 6)


def test_hardware_text_m4_with_stderr_noise() -> None:
    hw = parse_system_profiler_hardware_text(fx(HW_TEXT))
    assert hw.model_id == "Mac16,12"
    assert hw.chip == "Apple M4"
    assert hw.model_name == "MacBook Air"
    assert hw.memory_bytes == 16 * 2**30
    assert (hw.cores_total, hw.cores_performance, hw.cores_efficiency) == (10, 4, 6)


# ---------------------------------------------------------------------------
# Linux
# ---------------------------------------------------------------------------

IP_J_ADDR = json.dumps(
    [
        {
            "ifindex": 1,
            "ifname": "lo",
            "flags": ["LOOPBACK", "UP", "LOWER_UP"],
            "mtu": 65536,
            "operstate": "UNKNOWN",
            "link_type": "loopback",
            "address": "00:00:00:00:00:00",
            "addr_info": [
                {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host"},
                {"family": "inet6", "local": "::1", "prefixlen": 128, "scope": "host"},
            ],
        },
        {
            "ifindex": 2,
            "ifname": "eth0",
            "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
            "mtu": 1500,
            "master": "br0",
            "operstate": "UP",
            "link_type": "ether",
            "address": "52:54:00:12:34:56",
            "addr_info": [],
        },
        {
            "ifindex": 3,
            "ifname": "br0",
            "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
            "mtu": 1500,
            "operstate": "UP",
            "link_type": "ether",
            "address": "52:54:00:ab:cd:ef",
            "addr_info": [
                {"family": "inet", "local": "10.0.0.5", "prefixlen": 24, "label": "br0"},
                {"family": "inet6", "local": "fe80::5054:ff:feab:cdef", "prefixlen": 64},
            ],
        },
    ]
)


def test_ip_addr_json() -> None:
    ifaces = parse_ip_addr_json(IP_J_ADDR)
    assert list(ifaces) == ["lo", "eth0", "br0"]
    assert ifaces["lo"].ipv4 == ("127.0.0.1",)
    assert ifaces["lo"].ether is None
    assert ifaces["lo"].status == "unknown"
    br0 = ifaces["br0"]
    assert br0 == Interface(
        name="br0",
        flags=("BROADCAST", "MULTICAST", "UP", "LOWER_UP"),
        mtu=1500,
        ether="52:54:00:ab:cd:ef",
        ipv4=("10.0.0.5",),
        ipv6=("fe80::5054:ff:feab:cdef",),
        status="up",
        members=("eth0",),
        ipv4_cidrs=("10.0.0.5/24",),
    )
    assert br0.up and br0.active


def test_proc_meminfo() -> None:
    text = (
        "MemTotal:       16303456 kB\nMemFree:         1203400 kB\n"
        "MemAvailable:    9876540 kB\nBuffers:          204800 kB\n"
        "Cached:          7000000 kB\nSwapTotal:       2097148 kB\nSwapFree:        2097148 kB\n"
        "HugePages_Total:       0\nHugepagesize:       2048 kB\n"
    )
    mem = parse_proc_meminfo(text)
    assert mem.total_bytes == 16303456 * 1024
    assert mem.available_bytes == 9876540 * 1024
    assert mem.swap_total_bytes == 2097148 * 1024
    old_kernel = parse_proc_meminfo(text.replace("MemAvailable:    9876540 kB\n", ""))
    assert old_kernel.available_bytes == (1203400 + 204800 + 7000000) * 1024


def test_os_release() -> None:
    text = (
        'PRETTY_NAME="Ubuntu 24.04.1 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\n'
        'VERSION="24.04.1 LTS (Noble Numbat)"\nID=ubuntu\nID_LIKE=debian\n# comment\n\n'
    )
    rel = parse_os_release(text)
    assert (rel.id, rel.name, rel.version_id) == ("ubuntu", "Ubuntu", "24.04")
    assert rel.pretty_name == "Ubuntu 24.04.1 LTS"
    assert rel.id_like == ("debian",)
    assert parse_os_release('NAME="Some Linux"\n').id == "linux"


# ---------------------------------------------------------------------------
# RDMA summary and steps
# ---------------------------------------------------------------------------


def _summary_for(ibv: str, ifconfig: str, devinfo: str | None = None) -> probes.RdmaSummary:
    return rdma_summary(
        parse_rdma_ctl_status(fx(RDMA_CTL)),
        parse_ibv_devices(fx(ibv)),
        parse_thunderbolt_json(fx(TB_STUDIO)),
        parse_ifconfig(fx(ifconfig)),
        ibv_ports=parse_ibv_devinfo(fx(devinfo)) if devinfo else (),
    )


def test_rdma_summary_mini_with_bridge_still_in_place() -> None:
    s = _summary_for(IBV_MINI, IFC_BRIDGE, DEVINFO_ACTIVE)
    assert s.usable and s.status == "enabled"
    assert s.devices == ("rdma_en2", "rdma_en3", "rdma_en4")
    assert s.interfaces == ("en2", "en3", "en4")
    assert s.active_devices == ("rdma_en2", "rdma_en3", "rdma_en4")
    assert s.bridge_exists and s.bridge_active
    assert s.bridge_members == ("en2", "en3", "en4")
    assert any("TN3205" in n for n in s.notes)
    assert [p.model for p in s.peers] == ["Mac17,7"]


def test_rdma_summary_ports_down_and_missing_ipv4() -> None:
    s = rdma_summary(
        "enabled",
        parse_ibv_devices(fx(IBV_MBP)),
        None,
        parse_ifconfig(fx(IFC_NOADDR)),
        ibv_ports=parse_ibv_devinfo(fx(DEVINFO_DOWN)),
    )
    assert s.usable and s.active_devices == ()
    assert not s.bridge_exists
    assert any("PORT_ACTIVE" in n for n in s.notes)
    assert any(n.startswith("en2 has no IPv4") for n in s.notes)


def test_rdma_summary_enabled_without_devices() -> None:
    s = rdma_summary("enabled", parse_ibv_devices(fx(IBV_NONE)), None, {})
    assert not s.usable
    assert any("Thunderbolt 5" in n for n in s.notes)
    off = rdma_summary("disabled", (), ThunderboltReport(()), {})
    assert not off.usable and off.status == "disabled"
    assert rdma_summary("garbage", (), None, {}).status == "unknown"


def test_rdma_enable_steps() -> None:
    off = rdma_summary("disabled", (), None, parse_ifconfig(fx(IFC_ALL)))
    steps = rdma_enable_steps(off, "Darwin", "26.2")
    text = "\n".join(steps)
    assert "recoveryOS" in text and "Terminal" in text
    assert "rdma_ctl enable" in text
    assert text.index("rdma_ctl enable") < text.index("Restart")
    assert "TN3205" in steps[-1]  # bridge0 has en1..en3 as members
    assert rdma_enable_steps(off, "macOS", "")[0].startswith("Check that this Mac runs")


def test_rdma_enable_steps_refusals() -> None:
    off = rdma_summary("disabled", (), None, {})
    (linux,) = rdma_enable_steps(off, "Linux", "6.8.0")
    assert "not macOS" in linux
    (old,) = rdma_enable_steps(off, "Darwin", "15.5")
    assert "15.5" in old and "26.2" in old
    (also_old,) = rdma_enable_steps(off, "macOS", "26.1")
    assert "26.2" in also_old
    on = _summary_for(IBV_STUDIO, IFC_EN2)
    assert rdma_enable_steps(on, "macOS", "27.0")[0].startswith("RDMA is already enabled")


# ---------------------------------------------------------------------------
# Garbage: always ProbeParseError, naming the probe
# ---------------------------------------------------------------------------

_GARBAGE = "\x00\x01 lorem ipsum: dolor { sit amet\n\tconsectetur ]"


@pytest.mark.parametrize(
    ("parser", "probe"),
    [
        (parse_sysctl_value, "sysctl"),
        (parse_sysctl_memsize, "hw.memsize"),
        (parse_kern_boottime, "kern.boottime"),
        (parse_memory_pressure, "memory_pressure"),
        (parse_vm_stat, "vm_stat"),
        (parse_rdma_ctl_status, "rdma_ctl"),
        (parse_ibv_devices, "ibv_devices"),
        (parse_ibv_devinfo, "ibv_devinfo"),
        (parse_thunderbolt_json, "SPThunderboltDataType"),
        (parse_thunderbolt_text, "SPThunderboltDataType"),
        (parse_ifconfig, "ifconfig"),
        (parse_networksetup_ports, "networksetup"),
        (parse_macmon_line, "macmon"),
        (probes.parse_powermetrics, "powermetrics"),
        (probes.parse_psi, "pressure"),
        (parse_system_profiler_hardware_json, "SPHardwareDataType"),
        (parse_system_profiler_hardware_text, "SPHardwareDataType"),
        (parse_ip_addr_json, "ip -j addr"),
        (parse_proc_meminfo, "meminfo"),
        (parse_os_release, "os-release"),
    ],
)
def test_garbage_raises_probe_parse_error(parser: Callable[[str], Any], probe: str) -> None:
    with pytest.raises(ProbeParseError, match=probe) as info:
        parser(_GARBAGE)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ProbeParseError):
        parser(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (parse_sysctl_value, ""),
        (parse_sysctl_value, "a\nb\n"),
        (parse_sysctl_memsize, "hw.memsize: lots\n"),
        (parse_vm_stat, "Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"),
        (parse_ibv_devices, "    device          \t   node GUID\n    rdma_en2  not-a-guid\n"),
        (parse_ibv_devinfo, "\tport:\t1\n"),
        (parse_thunderbolt_json, "[]"),
        (parse_thunderbolt_json, '{"SPThunderboltDataType": [42]}'),
        (parse_thunderbolt_json, '{"SPThunderboltDataType": [{"_items": [7]}]}'),
        (parse_thunderbolt_json, '{"SPThunderboltDataType": [{"receptacle_1_tag": 5}]}'),
        (parse_thunderbolt_text, ""),
        (parse_ifconfig, ""),
        (parse_ifconfig, "\tinet 10.0.0.1 netmask 0xffffff00\n"),
        (parse_networksetup_ports, "Device: en0\n"),
        (parse_networksetup_ports, "Hardware Port: Wi-Fi\n"),
        (parse_macmon_line, '{"memory": {"ram_total": true}}'),
        (parse_macmon_line, "[1, 2]"),
        (parse_system_profiler_hardware_json, '{"SPHardwareDataType": []}'),
        (parse_ip_addr_json, '[{"ifindex": 1}]'),
        (parse_ip_addr_json, '{"ifname": "lo"}'),
        (parse_proc_meminfo, "MemFree: 12 kB\n"),
        (parse_os_release, "NAME='unterminated\n"),
    ],
)
def test_malformed_input_raises_probe_parse_error(parser: Callable[[str], Any], text: str) -> None:
    with pytest.raises(ProbeParseError):
        parser(text)


@pytest.mark.parametrize("name", _fixture_files())
def test_cut_recordings_raise_only_probe_parse_error(name: str) -> None:
    # A probe killed mid-output must give a result or ProbeParseError, nothing else.
    text, parser = fx(name), _parser_for(name)
    for cut in range(0, len(text), 7):
        for piece in (text[:cut], text[cut:]):
            with contextlib.suppress(ProbeParseError):
                parser(piece)
