"""The kind of a link from both ends' addresses and interface facts (pure, on the
recorded macOS outputs), and link bandwidth measured over CURVE PUSH/PULL by real
agents (the live part is in tests/test_app_dashboard.py's links test)."""

from __future__ import annotations

import pytest

from tests.support.fixture_paths import read_fixture
from worker.shared import probes
from worker.shared.probes import LinkEnd, end_kind, link_end_from, pair_link_kind

EN2 = "ifconfig_en2.tb-port-own-ipv4-ipv6.apple-tn3205.txt"
ALL = "ifconfig.all-interfaces.bridge0-members-en1-en3.apple-silicon-mac.jmw-parsing-test.txt"
PORTS_OSAURUS = (
    "networksetup_-listallhardwareports.m5max-macbookpro.macos27.osaurus-test.REDACTED-MACS.txt"
)
PORTS_WCV = "networksetup_-listallhardwareports.m5max-macbookpro-macos26.5.team-wcv-exo-test.txt"


def _ports(name: str) -> tuple[probes.HardwarePort, ...]:
    return probes.parse_networksetup_ports(read_fixture(name))


def test_ends_from_recorded_ifconfig_and_networksetup() -> None:
    tb = link_end_from(
        "169.254.205.255", probes.parse_ifconfig(read_fixture(EN2)), _ports(PORTS_OSAURUS)
    )
    assert tb == LinkEnd("169.254.205.255", "en2", "Thunderbolt 3", 16)
    assert end_kind(tb) == "thunderbolt"
    every = probes.parse_ifconfig(read_fixture(ALL))
    wifi = link_end_from("192.168.1.237", every, _ports(PORTS_OSAURUS))
    assert wifi == LinkEnd("192.168.1.237", "en0", "Wi-Fi", 24) and end_kind(wifi) == "wifi"
    assert end_kind(link_end_from("127.0.0.1", every)) == "loopback"
    # An address on no interface: the end is unknown, not guessed.
    assert end_kind(link_end_from("10.9.9.9", every)) == "unknown"
    labels = {p.device: p.port for p in _ports(PORTS_WCV)}
    # A dock's NIC is named "Thunderbolt Ethernet Slot N": Ethernet, not the bridge.
    assert end_kind(LinkEnd("10.0.0.2", "en10", labels["en10"], 24)) == "ethernet"
    assert end_kind(LinkEnd("10.0.0.2", "bridge0", labels["bridge0"], 16)) == "thunderbolt"
    assert end_kind(LinkEnd("10.0.0.2", "en16", labels["en16"], 24)) == "ethernet"


BRIDGE_A = LinkEnd("169.254.10.1", "bridge0", "Thunderbolt Bridge", 16)
BRIDGE_B = LinkEnd("169.254.20.2", "bridge0", "Thunderbolt Bridge", 16)


@pytest.mark.parametrize(
    ("a", "b", "kind"),
    [
        (BRIDGE_A, BRIDGE_B, "thunderbolt"),
        (BRIDGE_A, LinkEnd("169.254.20.2", "en2", "Thunderbolt 3", 16), "thunderbolt"),
        # Thunderbolt at both ends but different subnets: routed, not one cable.
        (BRIDGE_A, LinkEnd("10.0.5.2", "bridge0", "Thunderbolt Bridge", 24), "ethernet"),
        # The slower end decides.
        (BRIDGE_A, LinkEnd("169.254.20.2", "en0", "Wi-Fi", 16), "wifi"),
        (LinkEnd("10.0.0.1", "en8", "Ethernet", 24), BRIDGE_B, "ethernet"),
        (
            LinkEnd("10.0.0.1", "eth0", None, 24),
            LinkEnd("10.0.0.2", "enp3s0", None, 24),
            "ethernet",
        ),
        (LinkEnd("10.0.0.1", "wlp2s0", None, 24), LinkEnd("10.0.0.2", "eth0", None, 24), "wifi"),
        (
            LinkEnd("10.0.0.1", "thunderbolt0", None, 24),
            LinkEnd("10.0.0.2", "thunderbolt0", None, 24),
            "thunderbolt",
        ),
        (LinkEnd("127.0.0.11", "lo", None, 8), LinkEnd("127.0.0.12", "lo", None, 8), "loopback"),
        (LinkEnd("127.0.0.1"), LinkEnd("127.0.0.1"), "loopback"),
        (LinkEnd("10.0.0.1"), BRIDGE_B, "unknown"),
        (BRIDGE_A, None, "unknown"),
    ],
)
def test_pair_link_kind(a: LinkEnd, b: LinkEnd | None, kind: str) -> None:
    assert pair_link_kind(a, b) == kind
    assert pair_link_kind(b, a) == kind  # the same from either end


def test_link_end_travels_as_facts() -> None:
    import dataclasses

    wire = {**dataclasses.asdict(BRIDGE_A), "kind": "thunderbolt"}
    assert LinkEnd.from_facts(wire) == BRIDGE_A
    assert LinkEnd.from_facts({"address": "10.0.0.1", "prefix": True}) == LinkEnd("10.0.0.1")
    assert LinkEnd.from_facts(None) is None and LinkEnd.from_facts({"interface": "en0"}) is None
