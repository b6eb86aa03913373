"""Which RDMA device reaches which Mac: the port map on every recorded Thunderbolt
output (worker.shared.probes.thunderbolt_port_map), what an agent reports from
recorded outputs (worker.node_probe.rdma_facts with a replay folder), and the
operator's matching into JACCL's device matrix for 2, 3 and 4 Macs
(studiotui.core.members), including a missing cable and a port that is down.

Meshes of 3-4 Macs are derived from the recordings by tests/support/rdma_mesh.py (its
docstring says how); the pair of MacBook Pros is used exactly as recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from studiotui.app.panes.rdma import rdma_content
from studiotui.core.forecast import links_from_state
from studiotui.core.members import (
    GroupBackend,
    cables,
    group_backend,
    jaccl_devices,
    rdma_pair,
)
from studiotui.core.model_facts import read_model
from studiotui.core.placement import Link, NodeBudget, Plan, backend_for, plan
from studiotui.core.state import ClusterState, LinkState, NodeState
from tests.support import rdma_mesh
from tests.support.fixture_paths import (
    DEVINFO_DOWN,
    IBV_MBP,
    IBV_NONE,
    IBV_STUDIO,
    IFC_ALL,
    IFC_EN2,
    IFC_NOADDR,
    NS_EXO,
    NS_OSAURUS,
    RDMA_CTL,
    TB_MBP,
    TB_OFF,
    TB_ON,
    TB_STUDIO,
    TB_TEXT_NONE,
    TB_TEXT_PEER,
    read_fixture,
)
from tests.support.seed_models import seed_model
from worker import node_probe
from worker.shared.probes import (
    parse_ibv_devices,
    parse_ibv_devinfo,
    parse_ifconfig,
    parse_networksetup_ports,
    parse_thunderbolt_json,
    parse_thunderbolt_text,
    thunderbolt_port_map,
)
from worker.shared.protocol.messages import MessageError
from worker.shared.protocol.rdma import read_rdma

STUDIOS = ["studio-1", "studio-2", "studio-3", "studio-4"]
GiB = 1024**3
SP = ("system_profiler", "SPThunderboltDataType", "-json")


def fx(name: str) -> str:
    return read_fixture(name)


def _map(tb: str, ns: str | None = None, ibv: str | None = None, devinfo: str | None = None):
    return thunderbolt_port_map(
        parse_thunderbolt_json(fx(tb)),
        parse_networksetup_ports(fx(ns)) if ns else (),
        parse_ibv_devices(fx(ibv)) if ibv else (),
        parse_ibv_devinfo(fx(devinfo)) if devinfo else (),
    )


# ---------------------------------------------------------------------------
# The port map, on the recordings
# ---------------------------------------------------------------------------


def test_rdma_enabled_macbook_joins_port_interface_device_state_and_peer() -> None:
    ports = _map(TB_ON, NS_OSAURUS, IBV_MBP, DEVINFO_DOWN)
    assert [(p.receptacle, p.interface, p.rdma_device, p.state) for p in ports] == [
        (1, "en1", "rdma_en1", "PORT_DOWN"),
        (2, "en6", "rdma_en6", "PORT_DOWN"),  # Thunderbolt 2 is en6: not in order
        (3, "en2", "rdma_en2", "PORT_DOWN"),
    ]
    # The cable to the other MacBook Pro is on port 2; the TB3 enclosure on port 3 is
    # not a Mac (no domain UUID), so port 3 leads to no peer.
    assert [p.peer_uuid for p in ports] == [None, "00000004-0000-4000-8000-000000000004", None]
    assert ports[1].peer_model == "Mac17,6" and ports[1].link_gbps == 80.0
    assert [p.domain_uuid for p in ports] == [
        "00000005-0000-4000-8000-000000000005",
        "00000003-0000-4000-8000-000000000003",
        "00000002-0000-4000-8000-000000000002",
    ]
    assert not any(p.active for p in ports)


def test_rdma_disabled_macbook_has_ports_but_no_devices() -> None:
    ports = _map(TB_OFF, NS_OSAURUS, IBV_NONE)
    assert [(p.interface, p.rdma_device, p.state) for p in ports] == [
        ("en1", None, None),
        ("en6", None, None),
        ("en2", None, None),
    ]
    # Its peer is the RDMA-enabled one's port 2, and the other way round.
    on = {p.domain_uuid for p in _map(TB_ON)}
    assert ports[1].peer_uuid in on and ports[2].peer_uuid is None  # the dock is no Mac
    assert _map(TB_ON)[1].peer_uuid == ports[1].domain_uuid


def test_studio_and_macbook_of_the_omlx_pair_point_at_each_other() -> None:
    studio = _map(TB_STUDIO, ibv=IBV_STUDIO)
    mbp = _map(TB_MBP, NS_EXO)
    assert [p.receptacle for p in studio] == [1, 2, 3, 4, 5, 6]
    (to_mbp,) = [p for p in studio if p.peer_uuid]
    (to_studio,) = [p for p in mbp if p.peer_uuid]
    assert to_mbp.receptacle == 2 and to_mbp.peer_model == "Mac17,7"
    assert to_mbp.peer_uuid == to_studio.domain_uuid
    assert to_studio.peer_uuid == to_mbp.domain_uuid and to_studio.peer_model == "Mac15,14"
    # The OWC drive on port 4 has no domain UUID: never a peer.
    assert studio[3].peer_uuid is None and studio[3].link_gbps == 80.0
    # No Mac Studio networksetup was recorded: no interface, so no device is guessed.
    assert all(p.interface is None and p.rdma_device is None for p in studio)
    assert to_studio.interface == "en1"  # Thunderbolt 1 on the M5 Max MacBook Pro


def test_plain_text_recordings_give_ports_too() -> None:
    idle = thunderbolt_port_map(parse_thunderbolt_text(fx(TB_TEXT_NONE)), ())
    assert [p.receptacle for p in idle] == [1, 2, 3]
    assert all(p.domain_uuid and p.peer_uuid is None for p in idle)
    (cut,) = thunderbolt_port_map(parse_thunderbolt_text(fx(TB_TEXT_PEER)), ())
    assert (cut.receptacle, cut.peer_model, cut.link_gbps) == (3, "Mac16,9", 80.0)
    assert cut.peer_uuid == "88F10ACA-5CAA-4F5D-8361-03EED54ACB5A"


def test_a_peer_behind_a_hub_is_still_the_ports_peer() -> None:
    doc = json.loads(fx(TB_MBP))
    bus = doc["SPThunderboltDataType"][2]
    bus["_items"] = [{"_name": "Fusiondock", "_items": bus["_items"]}]
    ports = thunderbolt_port_map(parse_thunderbolt_json(json.dumps(doc)), ())
    assert ports[0].peer_model == "Mac15,14" and ports[0].peer_uuid


# ---------------------------------------------------------------------------
# What an agent reports, from recorded outputs it replays
# ---------------------------------------------------------------------------


def _replay(tmp: Path, files: dict[tuple[str, ...], str]) -> Path:
    folder = tmp / node_probe.REPLAY_FOLDER
    folder.mkdir(parents=True)
    for argv, name in files.items():
        (folder / node_probe.replay_name(argv)).write_text(fx(name))
    return folder


def test_an_agent_reports_its_ports_typed_from_the_recorded_macbook(tmp_path: Path) -> None:
    folder = _replay(
        tmp_path,
        {
            ("rdma_ctl", "status"): RDMA_CTL,
            ("ibv_devices",): IBV_MBP,
            ("ibv_devinfo",): DEVINFO_DOWN,
            SP: TB_ON,
            ("networksetup", "-listallhardwareports"): NS_OSAURUS,
        },
    )
    facts = read_rdma(node_probe.rdma_facts(folder))
    assert facts is not None and facts.os == "macOS" and facts.usable
    assert facts.devices == ("rdma_en1", "rdma_en6", "rdma_en2") and facts.active_devices == ()
    assert [(p.receptacle, p.device, p.state) for p in facts.ports] == [
        (1, "rdma_en1", "PORT_DOWN"),
        (2, "rdma_en6", "PORT_DOWN"),
        (3, "rdma_en2", "PORT_DOWN"),
    ]
    assert facts.ports[1].peer_uuid == "00000004-0000-4000-8000-000000000004"
    assert "00000003-0000-4000-8000-000000000003" in facts.own_uuids
    # A command with no recording is one that failed: no system_profiler, no ports.
    (
        folder / node_probe.replay_name(["system_profiler", "SPThunderboltDataType", "-json"])
    ).unlink()
    assert read_rdma(node_probe.rdma_facts(folder)).ports == ()  # type: ignore[union-attr]


def test_the_periodic_probe_lists_the_thunderbolt_bus_again_only_when_a_link_changed(
    tmp_path: Path,
) -> None:
    """An agent's rounds of probes, replayed from recorded MacBook outputs, counting the
    commands each round ran: the first lists the Thunderbolt bus (`system_profiler`,
    seconds on a Mac); the next, with nothing changed in the cheap probes, does not and
    reports the same facts (even with that recording gone: the listing was not read);
    a port whose link goes down in `ifconfig` brings the listing back (and its loss
    shows: no ports)."""
    folder = _replay(
        tmp_path,
        {
            ("rdma_ctl", "status"): RDMA_CTL,
            ("ibv_devices",): IBV_MBP,
            ("ibv_devinfo",): DEVINFO_DOWN,
            SP: TB_ON,
            ("networksetup", "-listallhardwareports"): NS_OSAURUS,
            ("ifconfig",): IFC_ALL,
        },
    )
    cheap = {
        "sw_vers_-productVersion",
        "rdma_ctl_status",
        "ibv_devices",
        "ibv_devinfo",
        "networksetup_-listallhardwareports",
        "ifconfig",
    }
    listing = node_probe.replay_name(SP)
    memo = node_probe.ProbeMemo()
    first = node_probe.rdma_facts(folder, memo)
    assert set(memo.ran) == cheap | {listing} and len(memo.ran) == 7
    assert read_rdma(first).ports  # type: ignore[union-attr]

    (folder / listing).unlink()
    second = node_probe.rdma_facts(folder, memo)
    assert set(memo.ran) == cheap and len(memo.ran) == 6
    assert second == first

    ifconfig = folder / "ifconfig"
    ifconfig.write_text(ifconfig.read_text().replace("status: inactive", "status: active", 1))
    third = node_probe.rdma_facts(folder, memo)
    assert listing in memo.ran
    assert read_rdma(third).ports == ()  # type: ignore[union-attr]
    # Unchanged again: the failed listing is tried again (it may have been a hiccup).
    node_probe.rdma_facts(folder, memo)
    assert listing in memo.ran


def test_unreadable_rdma_facts_are_refused_by_name() -> None:
    with pytest.raises(MessageError, match="ports"):
        read_rdma({"ports": [{"receptacle": "one"}]})
    assert "cannot be read" in rdma_pair("a", "b", {"a": {"ports": 3}, "b": {}})
    assert "b has not reported its RDMA facts" in rdma_pair("a", "b", {"a": {}, "b": None})


# ---------------------------------------------------------------------------
# The matching: JACCL's device matrix for 2, 3 and 4 Macs, or why not
# ---------------------------------------------------------------------------


def _oracle(outputs: dict[str, dict[str, str]], names: list[str]) -> list[list[str | None]]:
    """The matrix as MLX's own `mlx.distributed_config` reads it from the raw outputs
    (bus domain UUIDs, the first `_items` entry with one, networksetup's "Thunderbolt
    N"), independent of the project's parsers."""
    tb = node_probe.replay_name(["system_profiler", "SPThunderboltDataType", "-json"])
    ns = node_probe.replay_name(["networksetup", "-listallhardwareports"])
    buses = {n: json.loads(outputs[n][tb])["SPThunderboltDataType"] for n in names}
    owner = {b["domain_uuid_key"]: n for n in names for b in buses[n]}
    rows: list[list[str | None]] = []
    for i in names:
        iface: dict[str, str] = {}
        port = None
        for line in outputs[i][ns].splitlines():
            if line.startswith("Hardware Port:"):
                port = line.split(": ", 1)[1]
            elif line.startswith("Device:") and port:
                iface[port] = line.split(": ", 1)[1]
        row: list[str | None] = [None] * len(names)
        for b in buses[i]:
            peers = [x for x in b.get("_items", []) if "domain_uuid_key" in x]
            if peers and peers[0]["domain_uuid_key"] in owner:
                tag = b["receptacle_1_tag"]["receptacle_id_key"]
                row[names.index(owner[peers[0]["domain_uuid_key"]])] = (
                    f"rdma_{iface[f'Thunderbolt {tag}']}"
                )
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    ("model", "names"),
    [
        (rdma_mesh.MACBOOK, ["mbp-1", "mbp-2"]),
        (rdma_mesh.MACBOOK, ["mbp-1", "mbp-2", "mbp-3"]),
        (rdma_mesh.STUDIO, STUDIOS[:3]),
        (rdma_mesh.STUDIO, STUDIOS),
    ],
)
def test_a_full_mesh_gives_every_rank_its_devices(
    model: rdma_mesh.Model, names: list[str], tmp_path: Path
) -> None:
    outputs = rdma_mesh.mesh(model, names)
    got = jaccl_devices(names, rdma_mesh.facts(outputs, tmp_path))
    assert isinstance(got, list)
    assert got == _oracle(outputs, names)
    assert all(got[i][i] is None for i in range(len(names)))
    assert all(
        isinstance(got[i][j], str) for i in range(len(names)) for j in range(len(names)) if i != j
    )
    # Each rank reaches its peers through distinct ports.
    assert all(len({d for d in row if d}) == len(names) - 1 for row in got)


def test_the_four_studio_matrix_follows_the_ports_not_their_order(tmp_path: Path) -> None:
    got = jaccl_devices(
        STUDIOS, rdma_mesh.facts(rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS), tmp_path)
    )
    # studio-1 is cabled to studio-2/3/4 from its ports 1/2/3, which networksetup maps
    # to en5/en2/en7 (rdma_mesh.STUDIO_PORTS), whatever order ibv_devices lists them in.
    assert got[0] == [None, "rdma_en5", "rdma_en2", "rdma_en7"]
    # studio-4 from its ports 5/6/1 (port 4 holds the drive): en6/en4/en5.
    assert got[3] == ["rdma_en6", "rdma_en4", "rdma_en5", None]


def test_the_recorded_pair_refuses_naming_the_mac_without_rdma(tmp_path: Path) -> None:
    on = {
        ("rdma_ctl", "status"): RDMA_CTL,
        ("ibv_devices",): IBV_MBP,
        ("ibv_devinfo",): DEVINFO_DOWN,
        SP: TB_ON,
        ("networksetup", "-listallhardwareports"): NS_OSAURUS,
    }
    off = {
        **on,
        ("ibv_devices",): IBV_NONE,
        ("system_profiler", "SPThunderboltDataType", "-json"): TB_OFF,
    }
    del off[("ibv_devinfo",)]
    rdma = {
        "mbp-on": node_probe.rdma_facts(_replay(tmp_path / "on", on)),
        "mbp-off": node_probe.rdma_facts(_replay(tmp_path / "off", off)),
    }
    assert jaccl_devices(["mbp-on", "mbp-off"], rdma) == (
        "mbp-off has no usable RDMA device (rdma_ctl status, ibv_devices)"
    )
    # Were RDMA on at the other end too, the recorded port state still says no.
    rdma["mbp-off"] = node_probe.rdma_facts(
        _replay(
            tmp_path / "off2", {**on, ("system_profiler", "SPThunderboltDataType", "-json"): TB_OFF}
        )
    )
    assert jaccl_devices(["mbp-on", "mbp-off"], rdma) == (
        "rdma_en6 on mbp-on is down; rdma_en6 on mbp-off is down"
    )
    # Which port leads to which node, as the topology pane and status show it.
    assert [(c.node, c.receptacle, c.device, c.peer) for c in cables(rdma)] == [
        ("mbp-on", 2, "rdma_en6", "mbp-off"),
        ("mbp-off", 2, "rdma_en6", "mbp-on"),
    ]


def test_a_missing_cable_and_a_port_down_are_named(tmp_path: Path) -> None:
    cut = rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS, missing=[("studio-2", "studio-4")])
    assert jaccl_devices(STUDIOS, rdma_mesh.facts(cut, tmp_path / "cut")) == (
        "studio-2 has no cable to studio-4"
    )
    down = rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS, down=[("studio-1", "rdma_en2")])
    got = jaccl_devices(STUDIOS, rdma_mesh.facts(down, tmp_path / "down"))
    # Port 2 of studio-1 (en2) leads to studio-3: both ends of that cable are down.
    assert got == "rdma_en2 on studio-1 is down; rdma_en7 on studio-3 is down"
    # A group that avoids the bad cable still gets its matrix.
    assert isinstance(
        jaccl_devices(["studio-1", "studio-2", "studio-4"], rdma_mesh.facts(down, tmp_path / "d2")),
        list,
    )


def test_a_mac_with_rdma_off_is_named(tmp_path: Path) -> None:
    outputs = rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS[:3])
    outputs["studio-3"]["ibv_devices"] = fx(IBV_NONE)
    assert jaccl_devices(STUDIOS[:3], rdma_mesh.facts(outputs, tmp_path)) == (
        "studio-3 has no usable RDMA device (rdma_ctl status, ibv_devices)"
    )


# ---------------------------------------------------------------------------
# What the planner, the preview, fine-tuning and the benchmark then choose
# ---------------------------------------------------------------------------


def _state(rdma: dict[str, Any], measured: bool) -> ClusterState:
    names = list(rdma)
    nodes = tuple(
        NodeState(n, f"10.0.0.{i}", 52500, "ssh", state="up", facts={"rdma": rdma[n]})
        for i, n in enumerate(names, start=11)
    )
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    # Measured links say what the controller judged when it measured (here: nothing);
    # the facts the agents report now decide.
    links = tuple(LinkState(a, b, 150.0, 40.0, "thunderbolt") for a, b in pairs) if measured else ()
    return ClusterState(name="desk", nodes=nodes, links=links)


@pytest.mark.parametrize("measured", [True, False])
def test_the_backend_reason_names_the_missing_cable(tmp_path: Path, measured: bool) -> None:
    full = rdma_mesh.facts(rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS), tmp_path / "full")
    state = _state(full, measured)
    chosen = group_backend(STUDIOS, links_from_state(state), full)
    assert chosen.backend == "jaccl" and chosen.devices == jaccl_devices(STUDIOS, full)
    off = {**full, "studio-4": {"usable": False}}
    assert not group_backend(STUDIOS, links_from_state(_state(off, measured)), off).rdma_everywhere
    assert backend_for(STUDIOS, links_from_state(state))[0] == "jaccl"

    cut = rdma_mesh.facts(
        rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS, missing=[("studio-2", "studio-4")]),
        tmp_path / "cut",
    )
    state = _state(cut, measured)
    backend, why = backend_for(STUDIOS, links_from_state(state))
    if measured:
        # The preview's reason (the planner's backend_for over the links it is given).
        assert (backend, why) == (
            "ring",
            "studio-2 has no cable to studio-4: ring backend over TCP on the bridge addresses",
        )
    else:
        assert backend == "ring" and "studio-2 ↔ studio-4 has no RDMA" in why
    chosen = group_backend(STUDIOS, links_from_state(state), cut)
    # Ring for want of a cable, though every node has RDMA (the benchmark notes it).
    assert chosen.backend == "ring" and chosen.devices is None and chosen.rdma_everywhere
    assert chosen.reason.startswith("studio-2 ")
    alone = GroupBackend("ring", "one node: no group traffic")
    assert group_backend(["studio-1"], [], cut) == alone
    # A pair of nodes whose links were measured, without RDMA: the planner's words.
    plain = group_backend(["a", "b"], [Link("a", "b", 10.0, 40.0, "thunderbolt")], {})
    assert plain.reason.startswith("a ↔ b has no RDMA at both ends")
    # The other three still form a mesh.
    three = ["studio-1", "studio-2", "studio-3"]
    assert group_backend(three, links_from_state(state), cut).backend == "jaccl"


def test_the_planner_gives_a_four_studio_group_the_reason(tmp_path: Path) -> None:
    # What the preview shows for `--tensor 4` on the published Qwen3-235B (header-only
    # seed): JACCL on the full mesh; the ring, naming the cable, when one is missing.
    qwen = read_model(seed_model(tmp_path / "seeds", "qwen3-235b-a22b", "8bit")).facts
    four = [NodeBudget(n, 504 * GiB, 512 * GiB) for n in STUDIOS]
    full = rdma_mesh.facts(rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS), tmp_path / "full")
    placed = plan(qwen, four, links_from_state(_state(full, measured=True)), tensor=4)
    assert isinstance(placed, Plan) and placed.shape == "1 stage × 4 (jaccl)"
    cut = rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS, missing=[("studio-2", "studio-4")])
    state = _state(rdma_mesh.facts(cut, tmp_path / "cut"), measured=True)
    placed = plan(qwen, four, links_from_state(state), tensor=4)
    assert isinstance(placed, Plan) and placed.shape == "1 stage × 4 (ring)"
    assert placed.shards[0].backend_reason == (
        "studio-2 has no cable to studio-4: ring backend over TCP on the bridge addresses"
    )


def test_the_rdma_pane_lists_which_port_reaches_which_node(tmp_path: Path) -> None:
    cut = rdma_mesh.mesh(rdma_mesh.STUDIO, STUDIOS[:3], down=[("studio-1", "rdma_en2")])
    state = _state(rdma_mesh.facts(cut, tmp_path), measured=False)
    text = rdma_content(state.nodes).plain
    assert "Thunderbolt cables:" in text
    assert "studio-1  port 1 rdma_en5 → studio-2\n" in text
    assert "studio-1  port 2 rdma_en2 → studio-3 (port down)" in text
    assert "studio-3  port 4" not in text  # the drive on port 4 is no Mac


def test_two_cables_between_a_pair_name_both_ends_of_one_cable(tmp_path: Path) -> None:
    # studio-1's ports 1 and 2 lead to studio-2's ports 3 and 2 (crossed): studio-2's
    # lowest port is the *second* cable. Each side picking its own lowest would name two
    # cables, which JACCL cannot pair (exo PR #2160: a load that hung).
    pair = ["studio-1", "studio-2"]
    outputs = rdma_mesh.mesh(rdma_mesh.STUDIO, pair, doubled=[("studio-1", "studio-2")])
    rdma = rdma_mesh.facts(outputs, tmp_path / "both")
    assert [(c.node, c.receptacle, c.peer) for c in cables(rdma)] == [
        ("studio-1", 1, "studio-2"),
        ("studio-1", 2, "studio-2"),
        ("studio-2", 2, "studio-1"),
        ("studio-2", 3, "studio-1"),
    ]
    # Port 1 of studio-1 is en5; its cable ends on studio-2's port 3, en7.
    assert jaccl_devices(pair, rdma) == [[None, "rdma_en5"], ["rdma_en7", None]]
    assert jaccl_devices(pair, rdma) == _oracle_one_cable(outputs, pair)
    # That cable down: the other one, again both of its ends (en2 and en2).
    down = rdma_mesh.mesh(
        rdma_mesh.STUDIO, pair, doubled=[("studio-1", "studio-2")], down=[("studio-1", "rdma_en5")]
    )
    got = jaccl_devices(pair, rdma_mesh.facts(down, tmp_path / "down"))
    assert got == [[None, "rdma_en2"], ["rdma_en2", None]]


def _oracle_one_cable(outputs: dict[str, dict[str, str]], names: list[str]) -> list[list[Any]]:
    """Rank 1's device as the far end of rank 0's first cable, read from the raw JSON."""
    tb = node_probe.replay_name(SP)
    first = json.loads(outputs[names[0]][tb])["SPThunderboltDataType"]
    second = json.loads(outputs[names[1]][tb])["SPThunderboltDataType"]
    by_uuid = {
        b["domain_uuid_key"]: int(b["receptacle_1_tag"]["receptacle_id_key"]) for b in second
    }
    cabled = sorted(
        (int(b["receptacle_1_tag"]["receptacle_id_key"]), i["domain_uuid_key"])
        for b in first
        for i in b.get("_items", [])
        if i.get("domain_uuid_key") in by_uuid
    )
    mine, far = cabled[0]
    ports = rdma_mesh.STUDIO_PORTS
    return [[None, f"rdma_{ports[mine]}"], [f"rdma_{ports[by_uuid[far]]}", None]]


def test_a_cabled_port_without_an_ipv4_address_is_named(tmp_path: Path) -> None:
    # The recorded MacBook Pro's Thunderbolt ports are bridge0 members with no address
    # of their own; JACCL needs each cabled port's own IPv4 (MLX PR #4191).
    ports = _map(TB_ON, NS_OSAURUS, IBV_MBP, DEVINFO_DOWN)
    assert [p.ipv4 for p in ports] == [None, None, None]  # ifconfig not given: unknown
    bridged = thunderbolt_port_map(
        parse_thunderbolt_json(fx(TB_ON)),
        parse_networksetup_ports(fx(NS_OSAURUS)),
        parse_ibv_devices(fx(IBV_MBP)),
        (),
        parse_ifconfig(fx(IFC_ALL)),
    )
    assert [(p.interface, p.ipv4) for p in bridged] == [("en1", ""), ("en6", ""), ("en2", "")]
    # studio-1 reaches studio-3 through port 2, en2: recorded without an address, then
    # with its own link-local one (Apple's TN3205).
    three = STUDIOS[:3]
    bare = rdma_mesh.mesh(rdma_mesh.STUDIO, three, ifconfig={"studio-1": IFC_NOADDR})
    assert jaccl_devices(three, rdma_mesh.facts(bare, tmp_path / "bare")) == (
        "en2 on studio-1 has no IPv4 address (JACCL needs one on each cabled port; "
        "a link-local 169.254.x.y will do)"
    )
    own = rdma_mesh.mesh(rdma_mesh.STUDIO, three, ifconfig={"studio-1": IFC_EN2})
    rdma = rdma_mesh.facts(own, tmp_path / "own")
    assert isinstance(jaccl_devices(three, rdma), list)
    assert read_rdma(rdma["studio-1"]).ports[1].ipv4 == "169.254.205.255"  # type: ignore[union-attr]
