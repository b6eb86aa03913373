"""The cluster inventory: finding `cluster.toml`, validating it, and writing it back.

Everything here is pure except `find_inventory`, `load_inventory` and `apply_ssh_config`,
which touch the file system. Validation errors carry the file, line and field so that a
typo in a hand-edited inventory is one glance away from being fixed.
"""

from __future__ import annotations

import getpass
import math
import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar, cast

import tomlkit
from asyncssh.config import SSHClientConfig
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import AoT

from studiotui.core.errors import StudioError

INVENTORY_FILENAME = "cluster.toml"
HOME_ENV = "STUDIOTUI_HOME"
DEFAULT_HOME = "~/.studiotui"

DEFAULT_CLUSTER_NAME = "cluster"
# Below every ephemeral range (Linux 32768-60999, macOS 49152-65535): a port the
# kernel handed out for an outgoing connection can never hold an agent's port, shards'
# ports (control + SHARD_PORT_OFFSET up) included, nor a simulated cluster's blocks.
DEFAULT_CONTROL_PORT = 28500
EPHEMERAL_FLOOR = 32768  # the lowest port either system hands out by itself
TELEMETRY_PORT_OFFSET = 1
SHARD_PORT_OFFSET = 10
DEFAULT_SSH_PORT = 22
DEFAULT_WORKDIR = "~/.studiotui"
DEFAULT_PYTHON = "python3"
LOCAL_ADDRESS = "127.0.0.1"

_T = TypeVar("_T")

Transport = Literal["ssh", "local"]
TRANSPORTS: tuple[Transport, ...] = ("ssh", "local")

TOP_KEYS = ("cluster", "nodes", "groups")
CLUSTER_KEYS = ("name",)
NODE_KEYS = (
    "name",
    "transport",
    "host",
    "port",
    "user",
    "identity",
    "address",
    "control_port",
    "workdir",
    "python",
    "memory_gb",
)

# Names end up in paths, comma lists and TOML keys, so keep them to a safe alphabet.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_NAME_RULE = "a name of letters, digits, '.', '_' or '-'"
# Shards take ports from control_port + SHARD_PORT_OFFSET upwards, so leave room above.
_MAX_CONTROL_PORT = 65535 - SHARD_PORT_OFFSET


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One machine (or one simulated machine) of the cluster.

    `host` is what is handed to ssh (a name or a ~/.ssh/config alias); `hostname` is
    what that alias resolves to, filled in by `apply_ssh_config`.
    """

    name: str
    transport: Transport = "ssh"
    host: str | None = None
    port: int | None = None
    user: str | None = None
    identity: str | None = None
    address: str
    control_port: int = DEFAULT_CONTROL_PORT
    workdir: str = DEFAULT_WORKDIR
    python: str = DEFAULT_PYTHON
    memory_gb: float | None = None
    hostname: str | None = None
    ssh_config_applied: bool = False

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @property
    def ssh_host(self) -> str:
        # Like `ssh NAME`: without a host the node's name is the ssh host (or alias).
        return self.host or self.name

    @property
    def telemetry_port(self) -> int:
        return self.control_port + TELEMETRY_PORT_OFFSET

    @property
    def shard_port_base(self) -> int:
        return self.control_port + SHARD_PORT_OFFSET

    @property
    def control_endpoint(self) -> str:
        return tcp_endpoint(self.address, self.control_port)

    @property
    def telemetry_endpoint(self) -> str:
        return tcp_endpoint(self.address, self.telemetry_port)


@dataclass(frozen=True, kw_only=True)
class Inventory:
    name: str
    nodes: tuple[NodeSpec, ...]
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    path: Path | None = None

    def __post_init__(self) -> None:
        # A read-only view keeps the "frozen" promise for the one mutable-looking field.
        if not isinstance(self.groups, MappingProxyType):
            object.__setattr__(self, "groups", MappingProxyType(dict(self.groups)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(node.name for node in self.nodes)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def tcp_endpoint(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"tcp://{host}:{port}"


# --------------------------------------------------------------------------- errors


class InventoryError(StudioError, ValueError):
    """A refusal of an inventory, located as `file:line[:column]: field: message`."""

    def __init__(
        self,
        path: Path | None,
        line: int | None,
        field: str | None,
        message: str,
        *,
        column: int | None = None,
    ) -> None:
        super().__init__(format_error(path, line, field, message, column=column))
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        self.column = column

    def __str__(self) -> str:
        return format_error(self.path, self.line, self.field, self.message, column=self.column)


def format_error(
    path: Path | None,
    line: int | None,
    field: str | None,
    message: str,
    *,
    column: int | None = None,
) -> str:
    location = [str(path) if path is not None else "<inventory>"]
    if line is not None:
        location.append(str(line))
        if column is not None:
            location.append(str(column))
    prefix = ":".join(location)
    return f"{prefix}: {field}: {message}" if field else f"{prefix}: {message}"


class SelectionError(StudioError, ValueError):
    """A node selection (`resolve_group`) named nodes or groups the inventory lacks."""

    def __init__(self, unknown: Sequence[str], inventory: Inventory) -> None:
        self.unknown = tuple(unknown)
        self.known_nodes = inventory.names
        self.known_groups = tuple(inventory.groups)
        super().__init__(_selection_message(self.unknown, self.known_nodes, self.known_groups))


def _selection_message(unknown: Sequence[str], nodes: Sequence[str], groups: Sequence[str]) -> str:
    if not unknown:
        head = "empty node selection"
    else:
        quoted = ", ".join(f'"{name}"' for name in unknown)
        head = f"unknown node{'s' if len(unknown) > 1 else ''} or group {quoted}"
    known = f"known nodes: {', '.join(nodes) or '(none)'}"
    if groups:
        known += f"; groups: {', '.join(groups)}"
    return f"{head} ({known})"


# --------------------------------------------------------------------------- locating fields


@dataclass(frozen=True)
class FieldRef:
    """A field of the TOML document: `key` inside `table` (its `index`-th entry if an array)."""

    table: str
    index: int | None = None
    key: str | None = None

    def __str__(self) -> str:
        owner = self.table if self.index is None else f"{self.table}[{self.index}]"
        if self.key is None:
            return owner
        return f"{owner}.{self.key}" if owner else self.key


_ARRAY_HEADER_RE = re.compile(r"\s*\[\[\s*([^\[\]]+?)\s*\]\]")
_TABLE_HEADER_RE = re.compile(r"\s*\[\s*([^\[\]]+?)\s*\]")


def _dotted(name: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in name.split("."))


def _header(line: str) -> tuple[str, bool] | None:
    if match := _ARRAY_HEADER_RE.match(line):
        return _dotted(match[1]), True
    if match := _TABLE_HEADER_RE.match(line):
        return _dotted(match[1]), False
    return None


def _key_re(key: str) -> re.Pattern[str]:
    quoted = re.escape(key)
    return re.compile(rf"\s*(?:{quoted}|\"{quoted}\"|'{quoted}')\s*[=.]")


def _is_subtable(header: str, table: str, key: str) -> bool:
    own = f"{table}.{key}" if table else key
    return header == own or header.startswith(own + ".")


def find_field_line(
    text: str, table: str, index: int | None = None, key: str | None = None
) -> int | None:
    """1-based line of `key` in `[table]`, or in the `index`-th `[[table]]`; `table=""` is the root.

    tomllib reports no positions for values it parsed fine, so semantic errors are located by
    scanning the text. Falls back to the table's header line when the key is absent (the
    place to add it), and to None when the table itself is not found.
    """
    key_re = _key_re(key) if key is not None else None
    arrays_seen: dict[str, int] = {}
    in_section = table == ""
    section_line: int | None = 1 if in_section else None
    for number, line in enumerate(text.splitlines(), start=1):
        header = _header(line)
        if header is None:
            if in_section and key_re is not None and key_re.match(line):
                return number
            continue
        name, is_array = header
        if is_array:
            arrays_seen[name] = arrays_seen.get(name, -1) + 1
        # Root keys may be whole tables anywhere in the file; other keys live in their section.
        if (in_section or table == "") and key is not None and _is_subtable(name, table, key):
            return number
        in_section = name == table and (index is None or (is_array and arrays_seen[name] == index))
        if in_section:
            if key is None:
                return number
            section_line = number
    return section_line


def _field_line(text: str, ref: FieldRef) -> int | None:
    line = find_field_line(text, ref.table, ref.index, ref.key)
    if line is None and ref.table:
        # Inline arrays (`nodes = [{...}]`) have no headers: point at the array instead.
        line = find_field_line(text, "", None, ref.table.split(".")[0])
    return line


_TOML_POSITION_RE = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$")
_TOML_END_RE = re.compile(r"^(?P<msg>.*?)\s*\(at end of document\)$")


def toml_error_position(message: str, text: str) -> tuple[int | None, int | None, str]:
    """Split tomllib's `"... (at line L, column C)"` into (line, column, message)."""
    if match := _TOML_POSITION_RE.match(message):
        return int(match["line"]), int(match["col"]), match["msg"]
    if match := _TOML_END_RE.match(message):
        return max(1, len(text.splitlines())), None, f"{match['msg']} at end of file"
    return None, None, message


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class _Source:
    text: str
    path: Path | None

    def error(self, ref: FieldRef, message: str) -> InventoryError:
        return InventoryError(self.path, _field_line(self.text, ref), str(ref) or None, message)


def _show(value: object) -> str:
    """Render a bad value the way it looked in the TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return str(value)


def _expect_str(src: _Source, ref: FieldRef, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise src.error(ref, f"expected a non-empty string, got {_show(value)}")
    return value


def _expect_name(src: _Source, ref: FieldRef, value: object) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise src.error(ref, f"expected {_NAME_RULE}, got {_show(value)}")
    return value


def _expect_int(src: _Source, ref: FieldRef, value: object, low: int, high: int) -> int:
    # bool is an int subclass in Python but `true` is no port number.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise src.error(ref, f"expected an integer {low}-{high}, got {_show(value)}")
    return value


def _expect_positive_number(src: _Source, ref: FieldRef, value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(cast(float, value)) or cast(float, value) <= 0:
        raise src.error(ref, f"expected a positive number, got {_show(value)}")
    return float(cast(float, value))


def _expect_table(src: _Source, ref: FieldRef, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise src.error(ref, f"expected a table, got {_show(value)}")
    return value


def _reject_unknown_keys(
    src: _Source, table: Mapping[str, object], allowed: Sequence[str], owner: FieldRef
) -> None:
    for key in table:
        if key not in allowed:
            raise src.error(replace(owner, key=key), f"unknown key; allowed: {', '.join(allowed)}")


def _load_toml(src: _Source) -> dict[str, Any]:
    try:
        return tomllib.loads(src.text)
    except tomllib.TOMLDecodeError as exc:
        line, column, message = toml_error_position(str(exc), src.text)
        raise InventoryError(
            src.path, line, None, f"invalid TOML: {message}", column=column
        ) from exc
    except RecursionError:
        # tomllib recurses once per nested array or table: thousands of '[' exhaust
        # Python's stack before the parser can say where.
        raise InventoryError(src.path, None, None, "invalid TOML: arrays nest too deep") from None


def _parse_cluster_name(src: _Source, data: Mapping[str, object]) -> str:
    if "cluster" not in data:
        return DEFAULT_CLUSTER_NAME
    ref = FieldRef("cluster")
    table = _expect_table(src, FieldRef("", None, "cluster"), data["cluster"])
    _reject_unknown_keys(src, table, CLUSTER_KEYS, ref)
    if "name" not in table:
        return DEFAULT_CLUSTER_NAME
    return _expect_name(src, replace(ref, key="name"), table["name"])


def _parse_transport(src: _Source, ref: FieldRef, value: object) -> Transport:
    if value not in TRANSPORTS:
        choices = " or ".join(f'"{t}"' for t in TRANSPORTS)
        raise src.error(ref, f"expected {choices}, got {_show(value)}")
    return value


def _optional(
    raw: Mapping[str, object],
    key: str,
    parse: Callable[[_Source, FieldRef, object], _T],
    src: _Source,
    owner: FieldRef,
) -> _T | None:
    return parse(src, replace(owner, key=key), raw[key]) if key in raw else None


def _parse_node(src: _Source, index: int, raw: object) -> NodeSpec:
    owner = FieldRef("nodes", index)
    table = _expect_table(src, owner, raw)
    _reject_unknown_keys(src, table, NODE_KEYS, owner)
    if "name" not in table:
        raise src.error(replace(owner, key="name"), f"missing; every node needs {_NAME_RULE}")
    name = _expect_name(src, replace(owner, key="name"), table["name"])
    transport = _parse_transport(
        src, replace(owner, key="transport"), table.get("transport", "ssh")
    )
    local = transport == "local"

    if "address" in table:
        address = _expect_address(src, replace(owner, key="address"), table["address"])
    elif local:
        address = LOCAL_ADDRESS
    else:
        raise src.error(
            replace(owner, key="address"),
            "missing; ssh nodes need the address their agent binds its sockets to "
            '(e.g. address = "169.254.10.1" on the Thunderbolt bridge)',
        )

    def port(s: _Source, r: FieldRef, v: object) -> int:
        return _expect_int(s, r, v, 1, 65535)

    def control_port(s: _Source, r: FieldRef, v: object) -> int:
        return _expect_int(s, r, v, 1, _MAX_CONTROL_PORT)

    workdir = _optional(table, "workdir", _expect_str, src, owner)
    return NodeSpec(
        name=name,
        transport=transport,
        host=_optional(table, "host", _expect_str, src, owner),
        port=_optional(table, "port", port, src, owner),
        user=_optional(table, "user", _expect_str, src, owner),
        identity=_optional(table, "identity", _expect_str, src, owner),
        address=address,
        control_port=_optional(table, "control_port", control_port, src, owner)
        or DEFAULT_CONTROL_PORT,
        workdir=workdir or (f"{DEFAULT_WORKDIR}/local/{name}" if local else DEFAULT_WORKDIR),
        python=_optional(table, "python", _expect_str, src, owner) or DEFAULT_PYTHON,
        memory_gb=_optional(table, "memory_gb", _expect_positive_number, src, owner),
    )


def _expect_address(src: _Source, ref: FieldRef, value: object) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise src.error(ref, f"expected an IP address or host name, got {_show(value)}")
    return value


def _parse_nodes(src: _Source, data: Mapping[str, object]) -> tuple[NodeSpec, ...]:
    ref = FieldRef("", None, "nodes")
    raw = data.get("nodes")
    if raw is None:
        raise src.error(ref, "no nodes; add at least one [[nodes]] table")
    if not isinstance(raw, list):
        raise src.error(ref, f"expected an array of [[nodes]] tables, got {_show(raw)}")
    if not raw:
        raise src.error(ref, "no nodes; add at least one [[nodes]] table")
    return tuple(_parse_node(src, index, item) for index, item in enumerate(raw))


def _occupied_ports(node: NodeSpec) -> frozenset[int]:
    return frozenset((node.control_port, node.telemetry_port))


def _check_unique(src: _Source, nodes: Sequence[NodeSpec]) -> None:
    for index, node in enumerate(nodes):
        for earlier_index, earlier in enumerate(nodes[:index]):
            if node.name == earlier.name:
                raise src.error(
                    FieldRef("nodes", index, "name"),
                    f'duplicate node name "{node.name}" (already used by nodes[{earlier_index}])',
                )
            clash = _occupied_ports(node) & _occupied_ports(earlier)
            if node.address == earlier.address and clash:
                raise src.error(
                    FieldRef("nodes", index, _port_key(src.text, index)),
                    f"address:port {node.address}:{min(clash)} is already used by "
                    f'nodes[{earlier_index}] "{earlier.name}" '
                    f"(each agent takes control_port and control_port+{TELEMETRY_PORT_OFFSET}); "
                    "give it another address or control_port",
                )


def _port_key(text: str, index: int) -> str:
    # Blame control_port when it was written down, otherwise the address.
    line = find_field_line(text, "nodes", index, "control_port")
    header = find_field_line(text, "nodes", index)
    return "control_port" if line is not None and line != header else "address"


def _parse_groups(
    src: _Source, data: Mapping[str, object], nodes: Sequence[NodeSpec]
) -> dict[str, tuple[str, ...]]:
    if "groups" not in data:
        return {}
    table = _expect_table(src, FieldRef("", None, "groups"), data["groups"])
    known = [node.name for node in nodes]
    groups: dict[str, tuple[str, ...]] = {}
    for group, members in table.items():
        ref = FieldRef("groups", None, group)
        _expect_name(src, ref, group)
        if group in known:
            raise src.error(ref, f'group name "{group}" is also a node name; rename one of them')
        if not isinstance(members, list) or not members:
            raise src.error(ref, f"expected a non-empty array of node names, got {_show(members)}")
        for member in members:
            if member not in known:
                raise src.error(
                    ref, f"unknown node {_show(member)}; known nodes: {', '.join(known)}"
                )
        groups[group] = tuple(dict.fromkeys(members))
    return groups


def parse_inventory(text: str, path: Path | None = None) -> Inventory:
    """Validate inventory TOML; `path` only labels errors and the result."""
    src = _Source(text, path)
    data = _load_toml(src)
    _reject_unknown_keys(src, data, TOP_KEYS, FieldRef(""))
    name = _parse_cluster_name(src, data)
    nodes = _parse_nodes(src, data)
    _check_unique(src, nodes)
    groups = _parse_groups(src, data, nodes)
    return Inventory(name=name, nodes=nodes, groups=groups, path=path)


# --------------------------------------------------------------------------- ssh config


def default_ssh_config_paths() -> tuple[Path, ...]:
    path = Path("~/.ssh/config").expanduser()
    return (path,) if path.is_file() else ()


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


_SSH_CONFIG_ERROR_RE = re.compile(r"^(?P<path>.*) line (?P<line>\d+): (?P<msg>.*)$")


def _ssh_config_error(exc: Exception, node: NodeSpec, paths: Sequence[Path]) -> InventoryError:
    message = str(exc)
    if match := _SSH_CONFIG_ERROR_RE.match(message):
        return InventoryError(Path(match["path"]), int(match["line"]), None, match["msg"])
    where = paths[0] if len(paths) == 1 else None
    return InventoryError(where, None, None, f"ssh config for node {node.name}: {message}")


def apply_ssh_config(
    node: NodeSpec, config_paths: Iterable[str | Path], *, local_user: str | None = None
) -> NodeSpec:
    """Fill host name, port, user and identity from ssh config files, as `ssh` would.

    Values written in the inventory win: they are handed to asyncssh's parser the way
    `ssh -p PORT -l USER` hands them to ssh, so the config only supplies what is missing.
    Local nodes are returned unchanged.
    """
    if node.transport != "ssh":
        return node
    paths = [Path(p).expanduser() for p in config_paths]
    paths = [p for p in paths if p.is_file()]
    user_here = _local_user() if local_user is None else local_user
    alias = node.ssh_host
    try:
        config = SSHClientConfig.load(
            None,
            paths,
            False,
            False,
            False,
            user_here,
            node.user if node.user is not None else (),
            alias,
            node.port if node.port is not None else (),
        )
    except (ValueError, OSError) as exc:
        raise _ssh_config_error(exc, node, paths) from exc
    identities = cast(Sequence[str], config.get("IdentityFile", ()) or ())
    return replace(
        node,
        host=alias,
        hostname=cast(str | None, config.get("Hostname")) or alias,
        port=node.port or cast(int | None, config.get("Port")) or DEFAULT_SSH_PORT,
        user=node.user or cast(str | None, config.get("User")) or user_here or None,
        identity=node.identity or (identities[0] if identities else None),
        ssh_config_applied=True,
    )


def with_ssh_config(
    inventory: Inventory, config_paths: Iterable[str | Path], *, local_user: str | None = None
) -> Inventory:
    paths = tuple(config_paths)
    nodes = tuple(apply_ssh_config(n, paths, local_user=local_user) for n in inventory.nodes)
    return replace(inventory, nodes=nodes)


# --------------------------------------------------------------------------- finding & loading


def studiotui_home(env: Mapping[str, str]) -> Path:
    return Path(env.get(HOME_ENV) or DEFAULT_HOME).expanduser()


def find_inventory(explicit: Path | None, cwd: Path, home: Path) -> Path | None:
    """`-i FILE`, else `./cluster.toml`, else `$STUDIOTUI_HOME/cluster.toml`, else None.

    An explicit path is returned even if missing: falling back silently would run
    against a cluster the user did not ask for.
    """
    if explicit is not None:
        explicit = explicit.expanduser()
        return explicit if explicit.is_absolute() else cwd / explicit
    for candidate in (cwd / INVENTORY_FILENAME, home / INVENTORY_FILENAME):
        if candidate.is_file():
            return candidate
    return None


def load_inventory(path: Path, *, ssh_config: Iterable[str | Path] | None = None) -> Inventory:
    """Read, validate and complete from ssh config (default `~/.ssh/config`) an inventory."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InventoryError(path, None, None, f"cannot read inventory: {reason}") from exc
    inventory = parse_inventory(text, path)
    paths = default_ssh_config_paths() if ssh_config is None else ssh_config
    return with_ssh_config(inventory, paths)


# --------------------------------------------------------------------------- simulated cluster


LOCAL_BASE_OCTET = 11
# On macOS the simulated nodes share 127.0.0.1; each takes its own block of ports
# (control, telemetry, then its shards' ports from control + SHARD_PORT_OFFSET up).
MAC_PORT_STRIDE = 100


def shares_loopback(platform: str) -> bool:
    """macOS answers only 127.0.0.1 on loopback unless aliases are added (sudo
    ifconfig lo0 alias ...), so there simulated nodes share it and differ by port."""
    return platform == "darwin"


def local_endpoints(
    n: int,
    platform: str,
    base_octet: int = LOCAL_BASE_OCTET,
    control_port: int = DEFAULT_CONTROL_PORT,
) -> list[tuple[str, int]]:
    """(address, control port) of each of `n` simulated nodes on `platform`."""
    if shares_loopback(platform):
        return [("127.0.0.1", control_port + k * MAC_PORT_STRIDE) for k in range(n)]
    return [(f"127.0.0.{base_octet + k}", control_port) for k in range(n)]


@dataclass(frozen=True)
class LocalLayout:
    base_octet: int
    control_port: int


def choose_local_layout(
    n: int,
    platform: str,
    is_free: Callable[[str, int], bool],
    control_port: int = DEFAULT_CONTROL_PORT,
    first_octet: int = LOCAL_BASE_OCTET,
) -> LocalLayout:
    """The first layout of `n` simulated nodes whose agent ports are all free.

    Another simulated cluster (another user, another home) may hold the default
    one; binding there would fail, so a first run steps aside: by tens of
    addresses on Linux, by whole blocks of ports on macOS, where there is only
    127.0.0.1. `is_free(address, port)` is the only I/O, passed in.
    """

    def free(base: int, port: int) -> bool:
        return _layout_free(n, platform, is_free, base, port)

    if shares_loopback(platform):
        step = n * MAC_PORT_STRIDE
        last = _MAX_CONTROL_PORT - (n - 1) * MAC_PORT_STRIDE
        for port in range(control_port, last + 1, step):
            if free(first_octet, port):
                return LocalLayout(first_octet, port)
        raise ValueError(f"no free ports on 127.0.0.1 for {n} local nodes from {control_port} up")
    for base in range(first_octet, 255 - n, 10):
        if free(base, control_port):
            return LocalLayout(base, control_port)
    raise ValueError(f"no free loopback range for {n} local nodes on port {control_port}")


def _layout_free(
    n: int, platform: str, is_free: Callable[[str, int], bool], base: int, port: int
) -> bool:
    return all(
        is_free(address, p)
        for address, control in local_endpoints(n, platform, base, port)
        for p in (control, control + TELEMETRY_PORT_OFFSET)
    )


def free_control_port(
    n: int,
    platform: str,
    is_free: Callable[[str, int], bool],
    after: int = DEFAULT_CONTROL_PORT,
    base_octet: int = LOCAL_BASE_OCTET,
) -> int | None:
    """The first control port above `after`, in whole blocks, where `n` simulated
    nodes' agent ports are all free: what `up --local N --port P` can be given when
    something else holds `after`'s. None when no block is free."""
    step = n * MAC_PORT_STRIDE if shares_loopback(platform) else MAC_PORT_STRIDE
    last = _MAX_CONTROL_PORT - (n - 1) * MAC_PORT_STRIDE
    for port in range(after + step, last + 1, step):
        if _layout_free(n, platform, is_free, base_octet, port):
            return port
    return None


def local_inventory(
    n: int,
    *,
    base_octet: int = LOCAL_BASE_OCTET,
    control_port: int = DEFAULT_CONTROL_PORT,
    memory_gb: float | None = None,
    home: Path,
    python: str | None = None,
    platform: str = sys.platform,
) -> Inventory:
    """`n` simulated nodes on this machine: loopback addresses 127.0.0.<base_octet>...
    on Linux, 127.0.0.1 with a block of ports each on macOS (see `local_endpoints`).

    They run on this interpreter by default: it already has the worker's dependencies,
    and an existing venv's python is used as is instead of building a new venv.
    """
    if n < 1:
        raise ValueError(f"a local cluster needs at least 1 node, got {n}")
    if memory_gb is not None and not memory_gb > 0:
        raise ValueError(f"memory_gb must be above 0, got {memory_gb}")
    if base_octet < 1 or base_octet + n - 1 > 254:
        raise ValueError(
            f"127.0.0.{base_octet}..127.0.0.{base_octet + n - 1} leaves the usable range 1-254"
        )
    endpoints = local_endpoints(n, platform, base_octet, control_port)
    if not 1 <= control_port <= endpoints[-1][1] <= _MAX_CONTROL_PORT:
        raise ValueError(
            f"control_port must be 1-{_MAX_CONTROL_PORT}, got {control_port}"
            + (f" (the last node's is {endpoints[-1][1]})" if len(endpoints) > 1 else "")
        )
    nodes = tuple(
        NodeSpec(
            name=f"local-{k}",
            transport="local",
            address=address,
            control_port=port,
            workdir=str(home / "local" / f"local-{k}"),
            python=python or sys.executable,
            memory_gb=None if memory_gb is None else float(memory_gb),
        )
        for k, (address, port) in enumerate(endpoints, start=1)
    )
    return Inventory(name="local", nodes=nodes, groups={}, path=None)


# --------------------------------------------------------------------------- writing


def _toml_string(value: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = []
    for char in value:
        if char in escapes:
            out.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_item(value: object) -> object:
    # Groups are tuples in an Inventory; TOML (and tomlkit) know arrays as lists.
    return list(value) if isinstance(value, tuple) else value


def _update(
    table: MutableMapping[str, Any],
    values: Mapping[str, object],
    defaults: Mapping[str, object] = MappingProxyType({}),
) -> None:
    """Set what changed, drop what is gone; a value left equal keeps its text and comment,
    and a default the table leaves unsaid stays unsaid."""
    for key in [k for k in table if k not in values]:
        del table[key]
    for key, value in values.items():
        if key not in table and key in defaults and defaults[key] == value:
            continue
        if key not in table or table[key] != _toml_item(value):
            table[key] = _toml_item(value)


_NODE_DEFAULTS = MappingProxyType(
    {f.name: f.default for f in fields(NodeSpec) if f.default is not MISSING}
)


def dump_inventory(inventory: Inventory, over: str | None = None) -> str:
    """The inventory as `cluster.toml` text; `parse_inventory` reads it back equal.

    Given the text of the file it replaces (`over`), that document is changed in place
    (tomlkit), so a user's comments, the order of keys and tables, and the layout of
    every value left as it was survive: only what changed is written."""
    try:
        doc = tomlkit.parse(over) if over else tomlkit.document()
    except TOMLKitError:
        doc = tomlkit.document()  # not TOML: nothing in it to keep, and it is replaced
    if "cluster" not in doc:
        doc["cluster"] = tomlkit.table()
    _update(doc["cluster"], {"name": inventory.name})
    existing = doc.get("nodes")
    if not isinstance(existing, AoT):
        existing = tomlkit.aot()
    # A node's table is found by name, so a kept node keeps its comments and key order.
    old = {str(table.get("name")): table for table in existing}
    for table in list(existing):
        if str(table.get("name")) not in inventory.names:
            existing.remove(table)
    for node in inventory.nodes:
        values = {k: getattr(node, k) for k in NODE_KEYS if getattr(node, k) is not None}
        if node.name in old:
            _update(old[node.name], values, _NODE_DEFAULTS)
        else:
            table = tomlkit.table()
            _update(table, values, _NODE_DEFAULTS)
            existing.append(table)
    doc["nodes"] = existing
    if inventory.groups:
        if "groups" not in doc:
            doc["groups"] = tomlkit.table()
        _update(doc["groups"], dict(inventory.groups))
    elif "groups" in doc:
        del doc["groups"]
    return tomlkit.dumps(doc)


# --------------------------------------------------------------------------- selecting


def resolve_group(inventory: Inventory, spec: str) -> tuple[str, ...]:
    """Node names for a group name or a comma list of node (or group) names, in order."""
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    known = set(inventory.names)
    unknown = [p for p in parts if p not in inventory.groups and p not in known]
    if unknown or not parts:
        raise SelectionError(unknown, inventory)
    names: list[str] = []
    for part in parts:
        names.extend(inventory.groups.get(part, (part,)))
    return tuple(dict.fromkeys(names))
