"""The dashboard's pure parts: drawing, colours, RDMA verdicts, themes, settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from studiotui.app.panes.log import log_line
from studiotui.app.panes.nodes import cluster_power, cluster_power_title, node_lines, sort_key
from studiotui.app.panes.rdma import rdma_view
from studiotui.app.panes.topology import cluster_links, describe_link, draw_topology
from studiotui.app.render import bar, sparkline, usage_style
from studiotui.app.themes import (
    DEFAULT_THEME,
    ThemeFileError,
    load_themes,
    load_ui,
    save_ui,
    theme_from_toml,
)
from studiotui.core.state import ClusterState, LogEntry, NodeState, PlacementState, ShardState

GB = 1024**3


def _node(i: int, **kw) -> NodeState:
    return NodeState(
        name=kw.pop("name", f"node-{i}"),
        address=kw.pop("address", f"127.0.0.{10 + i}"),
        control_port=52500,
        transport="local",
        state=kw.pop("state", "up"),
        memory_total=16 * GB,
        memory_used=kw.pop("used", 4 * GB),
        **kw,
    )


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("width", [24, 46, 76, 140])
def test_topology_draws_every_node_at_any_width(n: int, width: int) -> None:
    nodes = tuple(_node(i) for i in range(1, n + 1))
    shards = tuple(
        ShardState("p", node.name, i, n, i, i + 1, "ready") for i, node in enumerate(nodes)
    )
    state = ClusterState(nodes=nodes, placements=(PlacementState("p", "m", "/m", shards),))
    text = draw_topology(state, width, selected="node-1").plain
    for node in nodes:
        assert node.name in text
    if n > 1:
        assert "ring p" in text and "→" in text


def test_measured_links_come_from_the_agents() -> None:
    a = _node(1, facts={"links": [{"peer": "node-2", "kind": "thunderbolt", "latency_us": 31.5}]})
    b = _node(2, address="10.0.0.2")
    c = _node(3, address="10.0.0.3")
    links = {(link.a, link.b): link for link in cluster_links(ClusterState(nodes=(a, b, c)))}
    assert describe_link(links["node-1", "node-2"]) == "Thunderbolt bridge · 32 µs · Gb/s ?"
    assert describe_link(links["node-2", "node-3"]) == "unknown link · not measured"
    assert describe_link(links["node-1", "node-3"]).endswith("not measured")
    # Once both agents have said which interface they sit on, the kind follows from both.
    wifi = {"address": "10.0.0.3", "interface": "en0", "port": "Wi-Fi", "prefix": 24}
    eth = {"address": "10.0.0.2", "interface": "en8", "port": "Ethernet", "prefix": 24}
    b, c = _node(2, address="10.0.0.2", facts={"link_end": eth}), _node(3, facts={"link_end": wifi})
    links = {(link.a, link.b): link for link in cluster_links(ClusterState(nodes=(a, b, c)))}
    assert describe_link(links["node-2", "node-3"]) == "Wi-Fi · not measured"


def test_memory_colours_change_at_80_and_95_percent() -> None:
    assert usage_style(0.79) == "$success"
    assert usage_style(0.80) == "$warning"
    assert usage_style(0.95) == "$error"
    assert bar(0.5, 10).plain.count("█") == 5
    assert sparkline((0.0, 0.5, 1.0), 10) == "▁▅█"
    assert sparkline((0.2,) * 50, 4) == "▂▂▂▂"


def test_node_card_shows_what_is_known() -> None:
    node = _node(1, used=15 * GB, gpu_pct=40.0, power_w=None, memory_history=(0.5, 0.9))
    text = node_lines(node, 80, selected=True).plain
    assert "▶" in text and "node-1" in text and "15.0 GB / 16.0 GB" in text
    assert "gpu 40%" in text and "pwr" not in text  # no report yet: no power line
    narrow = node_lines(node, 40, selected=False).plain
    assert all(len(line) <= 40 for line in narrow.splitlines())
    busy = [_node(1, used=1 * GB), _node(2, used=9 * GB), _node(3, state="down")]
    assert min(busy, key=sort_key("memory")).name == "node-2"
    assert min(busy, key=sort_key("state")).name == "node-3"


def test_rdma_verdicts() -> None:
    linux = _node(1, facts={"os": "Linux", "os_version": "6.8"})
    assert rdma_view(linux).status.startswith("not a Mac")
    old = _node(2, facts={"os": "Darwin", "os_version": "15.6"})
    assert rdma_view(old).status.startswith("not macOS 26.2+")
    enabled = _node(
        3,
        facts={
            "os": "Darwin",
            "os_version": "26.2",
            "rdma": {"status": "enabled", "usable": True, "devices": ["rdma_en3"], "ports": []},
        },
    )
    assert rdma_view(enabled).status == "enabled (rdma_en3)"
    assert rdma_view(enabled).style == "$success"
    disabled = _node(
        4, facts={"os": "Darwin", "os_version": "26.2", "rdma": {"status": "disabled"}}
    )
    view = rdma_view(disabled)
    assert view.style == "$error" and any("rdma_ctl enable" in s for s in view.steps)
    assert view.status == "disabled"


def test_rdma_verdicts_of_agents_older_than_the_operator() -> None:
    mac = {"os": "Darwin", "os_version": "26.2"}
    # Sent before agents named their ports: the verdict reads, the cables cannot.
    no_ports = {"status": "enabled", "usable": True, "devices": ["rdma_en3"]}
    view = rdma_view(_node(1, facts={**mac, "rdma": no_ports}))
    assert view.status == "enabled (rdma_en3); agent too old to report its ports"
    assert view.style == "$warning"
    assert view.steps[-1].endswith("studiotui provision node-1")
    # A shape this operator does not read (a field of another type): named, no crash.
    for odd in ({"usable": "yes"}, {"ports": [{"receptacle": "one"}]}, ["enabled"]):
        view = rdma_view(_node(2, facts={**mac, "rdma": odd}))
        assert view.status.startswith("agent too old: its RDMA report does not read here ("), (
            odd,
            view.status,
        )
        assert view.style == "$warning"
        assert view.steps == (
            "Update the agent on node-2 to this operator's build: studiotui provision node-2",
        )
    # Nothing reported yet (the agent's first probe still running) is not "too old".
    assert rdma_view(_node(3, facts=mac)).status == "not probed by this agent yet"


def test_log_lines_wrap_under_themselves() -> None:
    entry = LogEntry(0.0, "error", "word " * 30)
    for width in (80, 40):
        lines = log_line(entry, width).plain.splitlines()
        assert "error: word" in lines[0] and len(lines) > 1
        assert all(line.startswith(" " * 9) and line[9] != " " for line in lines[1:])
    # An info entry starts right after its time: no empty level column between.
    info = log_line(LogEntry(0.0, "info", "cluster local: 4/4 nodes up"), 80).plain
    assert info[8:10] == " c"


def test_shipped_themes_load() -> None:
    themes, problems = load_themes()
    names = {t.name for t in themes}
    assert problems == []
    assert {DEFAULT_THEME, "studio-light", "studio-ansi"} <= names
    assert any(not t.dark for t in themes) and any(t.ansi for t in themes)


def test_a_bad_theme_file_is_refused_with_its_name() -> None:
    with pytest.raises(ThemeFileError, match=r"x\.toml: unknown key\(s\) primry"):
        theme_from_toml('name = "x"\nprimary = "#fff"\nprimry = "#000"\n', "x.toml")
    with pytest.raises(ThemeFileError, match="invalid TOML"):
        theme_from_toml("name = ", "y.toml")


def test_ui_settings_survive_damage(tmp_path: Path) -> None:
    assert load_ui(tmp_path) == {}
    (tmp_path / "ui.json").write_text("{not json")
    assert load_ui(tmp_path) == {}
    save_ui(tmp_path, theme="studio-light")
    save_ui(tmp_path, sort="cpu")
    assert load_ui(tmp_path) == {"theme": "studio-light", "sort": "cpu"}


def _watts(total: float, host: str, history: tuple[float, ...], **kw) -> dict:
    power = {"source": "macmon", "host": host, "total_w": total, "scope": "system", **kw}
    return {"power": power, "power_w": total, "power_history": history}


def test_node_card_power_and_pressure_line() -> None:
    node = _node(
        1,
        **_watts(58.4, "studio-1", (20.0, 40.0, 58.4), cpu_w=6.2, gpu_w=41.5, ane_w=0.0),
        pressure={"source": "memory_pressure", "pct": 74.0, "label": "pressure"},
        pressure_history=(50.0, 74.0),
    )
    lines = node_lines(node, 100, selected=False).plain.splitlines()
    assert len(lines) == 5
    assert lines[3].startswith("  pwr  58 W  cpu 6.2 gpu 41.5 ane 0.0  ")
    assert "pressure 74% " in lines[3] and lines[3].count("█") == 1  # 58.4 is the top
    # No figure: the card says so and why, and keeps the pressure it has.
    linux = _node(
        2,
        power={
            "source": None,
            "host": "h",
            "reason": "no RAPL: /sys/class/powercap does not exist",
        },
        pressure={"source": "psi", "pct": 1.5, "label": "stall"},
        pressure_history=(1.5,),
    )
    line = node_lines(linux, 120, selected=False).plain.splitlines()[3]
    assert line.startswith("  pwr  n/a   stall 1.5% ")
    assert line.endswith("no RAPL: /sys/class/powercap does not exist")
    assert all(len(x) <= 40 for x in node_lines(linux, 40, selected=False).plain.splitlines())
    # Where it does not fit (a 160-column dashboard's Nodes pane), its head says it whole.
    narrow = node_lines(linux, 60, selected=False).plain.splitlines()[3]
    assert narrow.endswith("no RAPL") and "…" not in narrow, narrow


def test_cluster_power_counts_each_machine_once() -> None:
    nodes = (
        _node(1, **_watts(50.0, "studio-1", (30.0, 40.0, 50.0))),
        _node(2, **_watts(100.0, "studio-2", (90.0, 100.0))),
        # A simulated node on studio-2's machine reports the same machine's watts.
        _node(3, **_watts(100.0, "studio-2", (90.0, 100.0))),
        _node(4, state="down", **_watts(80.0, "studio-4", (80.0,))),
        _node(5, power={"source": None, "host": "studio-5", "reason": "no macmon"}),
    )
    total, history, machines = cluster_power(nodes)
    assert (total, history, machines) == (150.0, (130.0, 150.0), 2)
    assert cluster_power_title(nodes).startswith("cluster 150 W (2 machines) ")
    assert cluster_power(nodes[4:]) == (None, (), 0) and cluster_power_title(nodes[4:]) == ""
    # Pressure alone (Linux without RAPL) still makes a title: the worst node.
    stall = {"source": "psi", "label": "stall"}
    calm = _node(6, pressure={**stall, "pct": 0.4})
    busy = _node(7, pressure={**stall, "pct": 3.25})
    assert cluster_power_title((nodes[4], calm, busy)) == "stall ≤ 3.2% (node-7)"


def test_rings_abbreviate_and_fold_between_hops() -> None:
    from textual.content import Content

    from studiotui.app.panes.placements import ring_text, short_ring
    from studiotui.app.render import node_abbreviations, ring_hops, wrap_hops
    from studiotui.core.state import PlannedShard

    assert node_abbreviations(["local-3", "local-2"]) == {"local-3": "l3", "local-2": "l2"}
    assert node_abbreviations(["local-10", "local-11"])["local-11"] == "l11"
    assert node_abbreviations(["studio1", "studio2"]) == {"studio1": "s1", "studio2": "s2"}
    assert node_abbreviations(["alpha", "beta"]) == {"alpha": "alpha", "beta": "beta"}
    assert node_abbreviations(["mac", "mac-2"]) == {"mac": "mac", "mac-2": "mac-2"}

    ring = tuple(PlannedShard(f"local-{n}", 2 * i, 2 * i + 2) for i, n in enumerate((2, 1, 4, 3)))
    shards = tuple(
        ShardState("p", p.node, i, 4, p.start, p.end, "ready")
        for i, p in enumerate(ring)
        if p.node != "local-4"
    )
    p = PlacementState("p", "m", "/m", shards, planned=ring)
    assert ring_text(p) == "local-2[0:2] → local-1[2:4] → ✗local-4[4:6] → local-3[6:8]"
    assert short_ring(p, 80) == "l2[0:2]→l1[2:4]→✗l4[4:6]→l3[6:8]"
    assert short_ring(p, 20) == "l2[0:2]→l1[2:4]…"
    # Folded at 40 cells: never inside a hop or an arrow, the state kept whole.
    head = Content("ring p  ")
    for width, tail in ((40, "broken"), (53, "broken"), (60, "ready")):
        lines = [x.plain for x in wrap_hops(head, ring_hops(p, closed=True), width, Content(tail))]
        assert all(len(x) <= width for x in lines) and len(lines) > 1, lines
        assert lines[0].startswith("ring p  local-2[0:2] → local-1[2:4]")
        # A folded line starts with an arrow (or is the state alone), never mid-hop.
        assert all(x.lstrip().startswith(("→ ", tail)) for x in lines[1:]), lines
        assert not any(x.rstrip().endswith("→") for x in lines), lines
        joined = " ".join(x.strip() for x in lines)
        assert "local-2[0:2] → local-1[2:4] → ✗local-4[4:6] → local-3[6:8] → local-2" in joined
        assert joined.endswith(f" {tail}")
