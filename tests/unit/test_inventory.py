from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studiotui.core.inventory import (
    DEFAULT_CONTROL_PORT,
    FieldRef,
    Inventory,
    InventoryError,
    LocalLayout,
    NodeSpec,
    SelectionError,
    apply_ssh_config,
    choose_local_layout,
    dump_inventory,
    find_field_line,
    find_inventory,
    free_control_port,
    load_inventory,
    local_endpoints,
    local_inventory,
    parse_inventory,
    resolve_group,
    studiotui_home,
    toml_error_position,
    with_ssh_config,
)

GOOD = """\
[cluster]
name = "desk"

[[nodes]]
name = "studio-1"
host = "studio-1.local"      # SSH host, or an alias from ~/.ssh/config
port = 22
user = "me"
identity = "~/.ssh/id_ed25519"
address = "169.254.10.1"
workdir = "~/.studiotui"
python = "python3"

[[nodes]]
name = "studio-2"
address = "169.254.10.2"
memory_gb = 128
control_port = 29000

[[nodes]]
name = "sim"
transport = "local"
address = "127.0.0.20"

[groups]
big = ["studio-1", "studio-2"]
"""


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str) -> Inventory:
    return load_inventory(write(tmp_path, text), ssh_config=())


# --------------------------------------------------------------------------- good file


def test_good_file_parses(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    inv = load_inventory(path, ssh_config=())

    assert inv.name == "desk"
    assert inv.path == path
    assert inv.names == ("studio-1", "studio-2", "sim")
    assert dict(inv.groups) == {"big": ("studio-1", "studio-2")}

    first = inv.node("studio-1")
    assert first.transport == "ssh"
    assert (first.host, first.port, first.user) == ("studio-1.local", 22, "me")
    assert first.identity == "~/.ssh/id_ed25519"
    assert first.control_endpoint == "tcp://169.254.10.1:28500"
    assert first.telemetry_endpoint == "tcp://169.254.10.1:28501"
    assert first.shard_port_base == 28510


def test_defaults(tmp_path: Path) -> None:
    inv = parse_inventory(GOOD, tmp_path / "cluster.toml")
    second = inv.node("studio-2")
    assert second.host is None and second.ssh_host == "studio-2"  # like `ssh studio-2`
    assert second.port is None and second.user is None and second.identity is None
    assert second.workdir == "~/.studiotui"
    assert second.python == "python3"
    assert second.memory_gb == 128.0
    assert second.control_endpoint == "tcp://169.254.10.2:29000"
    assert second.telemetry_endpoint == "tcp://169.254.10.2:29001"

    sim = inv.node("sim")
    assert sim.is_local and sim.host is None
    assert sim.workdir == "~/.studiotui/local/sim"


def test_local_node_address_defaults_to_loopback() -> None:
    inv = parse_inventory('[[nodes]]\nname = "a"\ntransport = "local"\n')
    assert inv.nodes[0].address == "127.0.0.1"
    assert inv.name == "cluster"


def test_ipv6_endpoint_is_bracketed() -> None:
    node = NodeSpec(name="v6", address="fe80::1", control_port=1000)
    assert node.control_endpoint == "tcp://[fe80::1]:1000"


def test_inventory_is_frozen() -> None:
    inv = parse_inventory(GOOD)
    with pytest.raises(AttributeError):
        inv.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        inv.groups["new"] = ()  # type: ignore[index]


# --------------------------------------------------------------------------- locating lines


LOCATE = """\
# comment
top = 1

[cluster]
name = "desk"

[[nodes]]
name = "a"
port = 1

[[ nodes ]]
name = "b"
"port" = 2
[nodes.extra]
x = 1

[groups]
big = [
  "a",
]
"""


@pytest.mark.parametrize(
    ("table", "index", "key", "line"),
    [
        ("", None, "top", 2),
        ("", None, "cluster", 4),
        ("", None, "groups", 17),
        ("cluster", None, "name", 5),
        ("cluster", None, None, 4),
        ("nodes", 0, None, 7),
        ("nodes", 0, "name", 8),
        ("nodes", 0, "port", 9),
        ("nodes", 1, "name", 12),
        ("nodes", 1, "port", 13),  # quoted key, spaced header
        ("nodes", 1, "extra", 14),  # a sub-table of the second node
        ("nodes", 0, "address", 7),  # absent key: the table header, where it belongs
        ("nodes", 2, "name", None),  # no such table
        ("groups", None, "big", 18),
        ("missing", None, "x", None),
    ],
)
def test_find_field_line(table: str, index: int | None, key: str | None, line: int | None) -> None:
    assert find_field_line(LOCATE, table, index, key) == line


def test_field_ref_str() -> None:
    assert str(FieldRef("nodes", 1, "port")) == "nodes[1].port"
    assert str(FieldRef("nodes", 1)) == "nodes[1]"
    assert str(FieldRef("cluster", None, "name")) == "cluster.name"
    assert str(FieldRef("", None, "nodes")) == "nodes"


def test_toml_error_position() -> None:
    assert toml_error_position("Invalid value (at line 3, column 8)", "") == (3, 8, "Invalid value")
    assert toml_error_position("Unterminated string (at end of document)", "a\nb\n") == (
        2,
        None,
        "Unterminated string at end of file",
    )
    assert toml_error_position("odd", "") == (None, None, "odd")


# --------------------------------------------------------------------------- refusals

TWO_NODES = """\
[cluster]
name = "desk"

[[nodes]]
name = "studio-1"
address = "169.254.10.1"

[[nodes]]
name = "studio-2"
address = "169.254.10.2"
{extra}
"""


def two_nodes(extra: str) -> str:
    return TWO_NODES.format(extra=extra)


REFUSALS = [
    pytest.param(
        two_nodes('port = "abc"'),
        11,
        "nodes[1].port",
        'expected an integer 1-65535, got "abc"',
        id="port-string",
    ),
    pytest.param(
        two_nodes("port = 70000"),
        11,
        "nodes[1].port",
        "expected an integer 1-65535, got 70000",
        id="port-range",
    ),
    pytest.param(
        two_nodes("port = true"),
        11,
        "nodes[1].port",
        "expected an integer 1-65535, got true",
        id="port-bool",
    ),
    pytest.param(
        two_nodes("control_port = 65530"),
        11,
        "nodes[1].control_port",
        "expected an integer 1-65525",
        id="control-port-no-room-for-shards",
    ),
    pytest.param(
        two_nodes('memory_gb = "lots"'),
        11,
        "nodes[1].memory_gb",
        'expected a positive number, got "lots"',
        id="memory-type",
    ),
    pytest.param(
        two_nodes("memory_gb = -1"),
        11,
        "nodes[1].memory_gb",
        "expected a positive number",
        id="memory-negative",
    ),
    pytest.param(
        two_nodes("user = 5"),
        11,
        "nodes[1].user",
        "expected a non-empty string, got 5",
        id="user-type",
    ),
    pytest.param(
        two_nodes('transport = "telnet"'),
        11,
        "nodes[1].transport",
        'expected "ssh" or "local", got "telnet"',
        id="bad-transport",
    ),
    pytest.param(
        two_nodes('colour = "red"'),
        11,
        "nodes[1].colour",
        "unknown key; allowed: name, transport, host, port, user, identity, address, "
        "control_port, workdir, python, memory_gb",
        id="unknown-node-key",
    ),
    pytest.param(
        '[cluster]\nname = "desk"\nsize = 3\n[[nodes]]\nname = "a"\naddress = "1.2.3.4"\n',
        3,
        "cluster.size",
        "unknown key; allowed: name",
        id="unknown-cluster-key",
    ),
    pytest.param(
        'extra = 1\n[[nodes]]\nname = "a"\naddress = "1.2.3.4"\n',
        1,
        "extra",
        "unknown key; allowed: cluster, nodes, groups",
        id="unknown-top-key",
    ),
    pytest.param(
        '[[nodes]]\nname = "a"\naddress = "1.2.3.4"\n\n[clusterr]\nname = "x"\n',
        5,
        "clusterr",
        "unknown key; allowed: cluster, nodes, groups",
        id="unknown-top-table",
    ),
    pytest.param('[cluster]\nname = "desk"\n', 1, "nodes", "no nodes", id="no-nodes"),
    pytest.param(
        'nodes = []\n\n[cluster]\nname = "desk"\n', 1, "nodes", "no nodes", id="empty-nodes"
    ),
    pytest.param(
        '[cluster]\nname = "desk"\nnodes = []\n',
        3,
        "cluster.nodes",
        "unknown key; allowed: name",
        id="root-key-written-under-a-table",
    ),
    pytest.param(
        '[nodes]\nname = "a"\n',
        1,
        "nodes",
        "expected an array of [[nodes]] tables",
        id="nodes-not-array",
    ),
    pytest.param(
        TWO_NODES.replace('"studio-2"', '"studio-1"').format(extra=""),
        9,
        "nodes[1].name",
        'duplicate node name "studio-1" (already used by nodes[0])',
        id="duplicate-name",
    ),
    pytest.param(
        TWO_NODES.replace("10.2", "10.1").format(extra=""),
        10,
        "nodes[1].address",
        'address:port 169.254.10.1:28500 is already used by nodes[0] "studio-1"',
        id="duplicate-endpoint",
    ),
    pytest.param(
        TWO_NODES.replace("10.2", "10.1").format(extra="control_port = 28501"),
        11,
        "nodes[1].control_port",
        "169.254.10.1:28501 is already used",
        id="control-port-on-telemetry-port",
    ),
    pytest.param(
        '[cluster]\nname = "desk"\n\n[[nodes]]\nname = "studio-1"\nhost = "h"\n',
        4,
        "nodes[0].address",
        "missing; ssh nodes need the address",
        id="missing-address",
    ),
    pytest.param(
        '[[nodes]]\naddress = "1.2.3.4"\n', 1, "nodes[0].name", "missing", id="missing-name"
    ),
    pytest.param(
        '[[nodes]]\nname = "a b"\naddress = "1.2.3.4"\n',
        2,
        "nodes[0].name",
        "expected a name of letters, digits",
        id="bad-name",
    ),
    pytest.param(
        two_nodes('\n[groups]\nbig = ["studio-1", "studio-9"]'),
        13,
        "groups.big",
        'unknown node "studio-9"; known nodes: studio-1, studio-2',
        id="group-unknown-node",
    ),
    pytest.param(
        two_nodes('\n[groups]\nbig = "studio-1"'),
        13,
        "groups.big",
        "expected a non-empty array of node names",
        id="group-not-array",
    ),
    pytest.param(
        two_nodes('\n[groups]\nstudio-1 = ["studio-2"]'),
        13,
        "groups.studio-1",
        "is also a node name",
        id="group-shadows-node",
    ),
    pytest.param(
        'nodes = [{name = "a", address = "1.2.3.4", port = "x"}]\n',
        1,
        "nodes[0].port",
        "expected an integer",
        id="inline-array-of-tables",
    ),
]


@pytest.mark.parametrize(("text", "line", "field", "message"), REFUSALS)
def test_refusals_name_file_line_and_field(
    tmp_path: Path, text: str, line: int, field: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as caught:
        load_inventory(path, ssh_config=())
    err = caught.value
    assert (err.path, err.line, err.field) == (path, line, field)
    assert str(err).startswith(f"{path}:{line}: {field}: ")
    assert message in str(err)


def test_error_message_shape() -> None:
    err = InventoryError(Path("cluster.toml"), 12, "nodes[1].port", 'expected x, got "abc"')
    assert str(err) == 'cluster.toml:12: nodes[1].port: expected x, got "abc"'
    assert isinstance(err, ValueError)


def test_toml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '[cluster]\nname = "desk"\n\n[[nodes]]\nname = \n')
    with pytest.raises(InventoryError) as caught:
        load_inventory(path, ssh_config=())
    err = caught.value
    assert (err.line, err.column) == (5, 8)
    assert str(err).startswith(f"{path}:5:8: invalid TOML: ")


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(InventoryError, match=r"absent\.toml: cannot read inventory"):
        load_inventory(path, ssh_config=())


# --------------------------------------------------------------------------- ssh config


SSH_CONFIG = """\
Host studio-1
    HostName 10.0.0.1
    Port 2222
    User alice
    IdentityFile ~/.ssh/studio_key

Host *
    User fallback
    IdentityFile ~/.ssh/id_default
"""


@pytest.fixture
def ssh_config(tmp_path: Path) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(SSH_CONFIG)
    return path


def test_ssh_config_fills_missing_fields(ssh_config: Path) -> None:
    node = NodeSpec(name="studio-1", host="studio-1", address="169.254.10.1")
    done = apply_ssh_config(node, [ssh_config], local_user="me")
    assert done.host == "studio-1"  # the alias stays what ssh is asked for
    assert done.hostname == "10.0.0.1"
    assert (done.port, done.user, done.identity) == (2222, "alice", "~/.ssh/studio_key")
    assert done.ssh_config_applied


def test_inventory_values_beat_ssh_config(ssh_config: Path) -> None:
    node = NodeSpec(
        name="studio-1",
        host="studio-1",
        port=22,
        user="bob",
        identity="~/.ssh/mine",
        address="169.254.10.1",
    )
    done = apply_ssh_config(node, [ssh_config], local_user="me")
    assert (done.hostname, done.port, done.user, done.identity) == (
        "10.0.0.1",
        22,
        "bob",
        "~/.ssh/mine",
    )


def test_unmatched_host_gets_wildcard_and_ssh_defaults(ssh_config: Path) -> None:
    node = NodeSpec(name="other", host="other.local", address="169.254.10.3")
    done = apply_ssh_config(node, [ssh_config], local_user="me")
    assert done.hostname == "other.local"
    assert (done.port, done.user, done.identity) == (22, "fallback", "~/.ssh/id_default")


def test_no_ssh_config_uses_ssh_defaults(tmp_path: Path) -> None:
    node = NodeSpec(name="n", host="n.local", address="10.0.0.9")
    done = apply_ssh_config(node, [tmp_path / "missing"], local_user="me")
    assert (done.hostname, done.port, done.user, done.identity) == ("n.local", 22, "me", None)


def test_local_nodes_ignore_ssh_config(ssh_config: Path) -> None:
    node = NodeSpec(name="studio-1", transport="local", address="127.0.0.11")
    assert apply_ssh_config(node, [ssh_config]) is node


def test_load_applies_ssh_config_with_node_name_as_alias(tmp_path: Path, ssh_config: Path) -> None:
    path = write(tmp_path, '[[nodes]]\nname = "studio-1"\naddress = "169.254.10.1"\n')
    inv = load_inventory(path, ssh_config=[ssh_config])
    node = inv.node("studio-1")
    assert (node.hostname, node.port, node.user) == ("10.0.0.1", 2222, "alice")


def test_with_ssh_config_covers_every_node(ssh_config: Path) -> None:
    inv = with_ssh_config(parse_inventory(GOOD), [ssh_config], local_user="me")
    assert [n.ssh_config_applied for n in inv.nodes] == [True, True, False]
    # studio-1's inventory host is studio-1.local, which no Host block but `*` matches.
    assert inv.node("studio-1").hostname == "studio-1.local"


def test_broken_ssh_config_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "ssh_config"
    path.write_text("Host x\n    Port notanumber\n")
    node = NodeSpec(name="x", host="x", address="10.0.0.1")
    with pytest.raises(InventoryError) as caught:
        apply_ssh_config(node, [path], local_user="me")
    assert (caught.value.path, caught.value.line) == (path, 2)


# --------------------------------------------------------------------------- local cluster


def test_local_inventory(tmp_path: Path) -> None:
    inv = local_inventory(3, memory_gb=64, home=tmp_path, platform="linux")
    assert inv.names == ("local-1", "local-2", "local-3")
    assert [n.address for n in inv.nodes] == ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
    assert all(n.transport == "local" and n.control_port == DEFAULT_CONTROL_PORT for n in inv.nodes)
    assert inv.nodes[2].workdir == str(tmp_path / "local" / "local-3")
    assert inv.nodes[0].memory_gb == 64.0
    assert inv.nodes[0].python == sys.executable
    assert inv.nodes[1].control_endpoint == "tcp://127.0.0.12:28500"


def test_local_inventory_options(tmp_path: Path) -> None:
    inv = local_inventory(
        2, base_octet=50, control_port=6000, home=tmp_path, python="py", platform="linux"
    )
    assert [n.control_endpoint for n in inv.nodes] == [
        "tcp://127.0.0.50:6000",
        "tcp://127.0.0.51:6000",
    ]
    assert inv.nodes[0].memory_gb is None and inv.nodes[0].python == "py"


@pytest.mark.parametrize(
    ("n", "octet", "port"), [(0, 11, 28500), (5, 252, 28500), (1, 0, 28500), (1, 11, 65530)]
)
def test_local_inventory_refuses_impossible_clusters(
    tmp_path: Path, n: int, octet: int, port: int
) -> None:
    with pytest.raises(ValueError):
        local_inventory(n, base_octet=octet, control_port=port, home=tmp_path)


def test_local_inventory_on_macos_shares_127_0_0_1_by_port(tmp_path: Path) -> None:
    inv = local_inventory(4, home=tmp_path, platform="darwin")
    assert [n.control_endpoint for n in inv.nodes] == [
        "tcp://127.0.0.1:28500",
        "tcp://127.0.0.1:28600",
        "tcp://127.0.0.1:28700",
        "tcp://127.0.0.1:28800",
    ]
    assert parse_inventory(dump_inventory(inv)) == inv
    with pytest.raises(ValueError, match="the last node's is 65590"):
        local_inventory(2, control_port=65490, home=tmp_path, platform="darwin")


def _free_except(*busy: tuple[str, int]):
    taken = set(busy)
    asked: list[tuple[str, int]] = []

    def is_free(address: str, port: int) -> bool:
        asked.append((address, port))
        return (address, port) not in taken

    return is_free, asked


@pytest.mark.parametrize(
    ("platform", "busy", "expected"),
    [
        ("linux", [], LocalLayout(11, 28500)),
        # Any busy agent port (control or telemetry) of any node moves the whole range.
        ("linux", [("127.0.0.14", 28501)], LocalLayout(21, 28500)),
        ("linux", [("127.0.0.11", 28500), ("127.0.0.22", 28500)], LocalLayout(31, 28500)),
        # 127.0.0.1 is not ours on Linux: busy there changes nothing.
        ("linux", [("127.0.0.1", 28500)], LocalLayout(11, 28500)),
        ("darwin", [], LocalLayout(11, 28500)),
        # On macOS the step is a block of ports, never another address.
        ("darwin", [("127.0.0.11", 28500)], LocalLayout(11, 28500)),
        ("darwin", [("127.0.0.1", 28701)], LocalLayout(11, 28900)),
        ("darwin", [("127.0.0.1", 28500), ("127.0.0.1", 29200)], LocalLayout(11, 29300)),
    ],
)
def test_choose_local_layout(
    platform: str, busy: list[tuple[str, int]], expected: LocalLayout
) -> None:
    is_free, asked = _free_except(*busy)
    layout = choose_local_layout(4, platform, is_free)
    assert layout == expected
    endpoints = local_endpoints(4, platform, layout.base_octet, layout.control_port)
    addresses = {a for a, _ in asked}
    if platform == "darwin":
        assert addresses == {"127.0.0.1"}
        assert [p for _, p in endpoints] == [layout.control_port + 100 * k for k in range(4)]
    else:
        assert "127.0.0.1" not in addresses
        assert len({a for a, _ in endpoints}) == 4
    # Every port the chosen layout's agents bind was asked about and is free.
    for address, port in endpoints:
        assert {(address, port), (address, port + 1)} <= set(asked)
        assert is_free(address, port) and is_free(address, port + 1)


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_choose_local_layout_says_when_nothing_is_free(platform: str) -> None:
    with pytest.raises(ValueError, match="no free"):
        choose_local_layout(4, platform, lambda address, port: False)


@pytest.mark.parametrize(
    ("platform", "busy", "expected"),
    [
        # The next block of ports on the same addresses, past any busy one.
        ("linux", [("127.0.0.12", 28501)], 28600),
        ("linux", [("127.0.0.12", 28501), ("127.0.0.11", 28600)], 28700),
        # On macOS the nodes are 127.0.0.1 ports P, P+100, …: a whole block further.
        ("darwin", [("127.0.0.1", 28500)], 28900),
        ("darwin", [("127.0.0.1", 28500), ("127.0.0.1", 29001)], 29300),
    ],
)
def test_free_control_port(platform: str, busy: list[tuple[str, int]], expected: int) -> None:
    is_free, _ = _free_except(*busy)
    assert free_control_port(4, platform, is_free, 28500) == expected
    assert free_control_port(4, platform, lambda address, port: False, 28500) is None


# --------------------------------------------------------------------------- round trip


def test_round_trip_of_parsed_file(tmp_path: Path) -> None:
    inv = parse_inventory(GOOD)
    assert parse_inventory(dump_inventory(inv)) == inv


def test_round_trip_after_ssh_config(ssh_config: Path) -> None:
    inv = with_ssh_config(parse_inventory(GOOD), [ssh_config], local_user="me")
    again = parse_inventory(dump_inventory(inv))
    for before, after in zip(inv.nodes, again.nodes, strict=True):
        assert (before.host, before.port, before.user, before.identity) == (
            after.host,
            after.port,
            after.user,
            after.identity,
        )


def test_round_trip_of_local_inventory(tmp_path: Path) -> None:
    inv = local_inventory(4, memory_gb=32.5, home=tmp_path, platform="linux")
    assert parse_inventory(dump_inventory(inv)) == inv


def test_round_trip_escapes_awkward_strings() -> None:
    node = NodeSpec(
        name="odd",
        address="10.0.0.1",
        workdir='C:\\dir "quoted"\tand\nnewline \x7f ü 😀',
        python="/opt/py thon/bin/python3",
    )
    inv = Inventory(name="x.y", nodes=(node,), groups={"dotted.group": ("odd",)})
    assert parse_inventory(dump_inventory(inv)) == inv


@given(st.text(min_size=1).filter(str.strip))
def test_round_trip_of_any_string(text: str) -> None:
    node = NodeSpec(name="n", address="10.0.0.1", workdir=text, user=text)
    inv = Inventory(name="c", nodes=(node,))
    assert parse_inventory(dump_inventory(inv)) == inv


def test_dump_looks_like_the_documented_format() -> None:
    text = dump_inventory(parse_inventory(GOOD))
    assert text.startswith('[cluster]\nname = "desk"\n\n[[nodes]]\nname = "studio-1"\n')
    assert '[groups]\nbig = ["studio-1", "studio-2"]\n' in text
    assert "hostname" not in text and "ssh_config_applied" not in text


# --------------------------------------------------------------------------- finding


def test_find_inventory_order(tmp_path: Path) -> None:
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    assert find_inventory(None, cwd, home) is None

    write(home, GOOD)
    assert find_inventory(None, cwd, home) == home / "cluster.toml"

    write(cwd, GOOD)
    assert find_inventory(None, cwd, home) == cwd / "cluster.toml"

    explicit = write(tmp_path, GOOD, "other.toml")
    assert find_inventory(explicit, cwd, home) == explicit


def test_find_inventory_explicit_is_relative_to_cwd_and_never_falls_back(tmp_path: Path) -> None:
    write(tmp_path, GOOD)
    assert find_inventory(Path("nope.toml"), tmp_path, tmp_path) == tmp_path / "nope.toml"


def test_studiotui_home() -> None:
    assert studiotui_home({"STUDIOTUI_HOME": "/srv/st"}) == Path("/srv/st")
    assert studiotui_home({}) == Path("~/.studiotui").expanduser()


# --------------------------------------------------------------------------- selecting


def test_resolve_group() -> None:
    inv = parse_inventory(GOOD)
    assert resolve_group(inv, "big") == ("studio-1", "studio-2")
    assert resolve_group(inv, "sim, studio-1") == ("sim", "studio-1")
    assert resolve_group(inv, "sim,big,studio-1") == ("sim", "studio-1", "studio-2")


@pytest.mark.parametrize(
    ("spec", "unknown"), [("nope", ("nope",)), ("sim,x,y", ("x", "y")), (" , ", ())]
)
def test_resolve_group_unknown_names(spec: str, unknown: tuple[str, ...]) -> None:
    inv = parse_inventory(GOOD)
    with pytest.raises(SelectionError) as caught:
        resolve_group(inv, spec)
    err = caught.value
    assert isinstance(err, ValueError)
    assert err.unknown == unknown
    assert "known nodes: studio-1, studio-2, sim; groups: big" in str(err)
    for name in unknown:
        assert f'"{name}"' in str(err)


# --------------------------------------------------------------------------- garbage


def _mutate(text: str, cuts: list[tuple[int, int, str]]) -> str:
    for at, length, insert in cuts:
        at %= len(text) + 1
        text = text[:at] + insert + text[at + length :]
    return text


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.one_of(
        st.lists(
            st.tuples(
                st.integers(0, 10_000),
                st.integers(0, 8),
                st.sampled_from(["", "=", "[", "]", '"', "\n", "[[nodes]]\n", "-1", "1e999",
                                 "true", "{}", "x = [[[[[[1]]]]]]", "\x00", "\ud800", "é"]),
            ),
            min_size=1,
            max_size=6,
        ).map(lambda cuts: _mutate(GOOD, cuts)),
        st.text(max_size=200),
        st.integers(100, 5000).map(lambda n: "x = " + "[" * n + "]" * n),
    )
)  # fmt: skip
def test_any_garbage_inventory_is_an_inventory_error_or_an_inventory(text: str) -> None:
    """A cluster.toml mangled anywhere: parsed, or refused with an InventoryError naming
    the file; never another exception (a traceback in the CLI and TUI)."""
    try:
        parse_inventory(text, Path("/x/cluster.toml"))
    except InventoryError as exc:
        assert "cluster.toml" in str(exc)


def test_the_default_ports_lie_below_the_ephemeral_ranges() -> None:
    """Linux hands out 32768-60999 and macOS 49152-65535 for outgoing connections: an
    agent port there can be taken by any client socket. A 4-node simulated cluster on
    macOS (blocks of MAC_PORT_STRIDE, shards above control) stays below both too."""
    from studiotui.core.inventory import (
        DEFAULT_CONTROL_PORT,
        EPHEMERAL_FLOOR,
        MAC_PORT_STRIDE,
        choose_local_layout,
    )

    assert DEFAULT_CONTROL_PORT >= 1024
    assert DEFAULT_CONTROL_PORT + 4 * MAC_PORT_STRIDE < EPHEMERAL_FLOOR <= 32768
    layout = choose_local_layout(4, "darwin", lambda address, port: True)
    assert layout.control_port + 4 * MAC_PORT_STRIDE < 32768
    # `serve` and `web` listen below both ranges too, and below the agents' ports.
    from studiotui.api.defaults import DEFAULT_PORT as SERVE_PORT
    from studiotui.cli.web import DEFAULT_PORT as WEB_PORT

    for port in (SERVE_PORT, WEB_PORT):
        assert 1024 <= port < DEFAULT_CONTROL_PORT, port
    assert SERVE_PORT != WEB_PORT


USERS_FILE = """\
# the desk under the window
[cluster]
name = "desk"  # shown on the dashboard

[[nodes]]
# the big one
name = "studio-1"
host = "studio-1.local"
address = "169.254.10.1"

[[nodes]]
address = "169.254.10.2"
name = "studio-2"
host = "studio-2.local"   # behind the switch

[[nodes]]
name = "old-mini"
address = "169.254.10.9"

[groups]
big = ["studio-1", "studio-2"]  # both Ultras
"""


def test_writing_over_a_users_file_keeps_its_comments_and_order() -> None:
    """A write changes only what changed: comments, key order and the values left alone
    stay as the user wrote them; a dropped node goes, a new one is added at the end."""
    inv = parse_inventory(USERS_FILE)
    studio_2 = replace(inv.node("studio-2"), memory_gb=64.0)
    new = NodeSpec(name="studio-3", address="169.254.10.3", host="studio-3.local")
    changed = replace(inv, nodes=(inv.node("studio-1"), studio_2, new))
    text = dump_inventory(changed, over=USERS_FILE)
    for comment in (
        "# the desk under the window",
        'name = "desk"  # shown on the dashboard',
        "# the big one",
        'host = "studio-2.local"   # behind the switch',
        'big = ["studio-1", "studio-2"]  # both Ultras',
    ):
        assert comment in text, text
    # studio-2's keys in the user's order, its new value after them; no default written.
    assert text.index('address = "169.254.10.2"') < text.index('name = "studio-2"')
    assert text.index('host = "studio-2.local"') < text.index("memory_gb = 64.0")
    assert "transport" not in text and "workdir" not in text
    assert "old-mini" not in text and text.index("studio-2") < text.index("studio-3")
    assert parse_inventory(text) == changed
    # Nothing changed, nothing rewritten.
    assert dump_inventory(inv, over=USERS_FILE) == USERS_FILE
