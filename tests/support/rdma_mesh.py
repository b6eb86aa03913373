"""macOS command outputs for Macs cabled into a mesh, derived from the recordings.

Nobody on the team has a Mac, and the public recordings (tests/fixtures/macos) are of
two Macs on one cable. A mesh of 2-4 Macs is derived from them here, mechanically:

- `system_profiler SPThunderboltDataType -json`: the recorded document of the model
  (Mac Studio M3 Ultra with its USB4 drive; MacBook Pro M5 Max with its dock), parsed
  and written back with every bus's own domain UUID replaced by one made for the node
  and port (uuid5), the recorded peer Mac removed from its bus, and a copy of that
  recorded peer entry (its services included) put on one free bus per cable, naming
  the other end's port UUID. Drives and docks stay where they were recorded.
- `networksetup -listallhardwareports`: the MacBook Pro's recording as it is
  (Thunderbolt 1/2/3 = en1/en6/en2). No Mac Studio recording exists: its six
  "Thunderbolt N" ports get a made-up, deliberately unordered mapping onto en2..en7
  (`STUDIO_PORTS`), in the recording's layout.
- `ibv_devices`: the model's recording as it is (M3 Ultra: MLX's docs; MBP: osaurus).
- `ibv_devinfo`: one device block of the osaurus recording repeated per device, its
  name replaced, and its state PORT_ACTIVE (4) where a cable joins two Macs with RDMA
  on, else PORT_DOWN (1) as recorded.
- `rdma_ctl status`: the recorded "enabled".

`replay(folder, outputs)` writes them where an agent reads recorded outputs instead of
running the commands (worker/node_probe.py `REPLAY_FOLDER`, `replay_name`).
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.fixture_paths import (
    DEVINFO_DOWN,
    IBV_MBP,
    IBV_STUDIO,
    NS_OSAURUS,
    RDMA_CTL,
    TB_ON,
    TB_STUDIO,
    read_fixture,
)
from worker import node_probe
from worker.shared.probes import parse_networksetup_ports, thunderbolt_ports

_UUIDS = uuid.UUID("5f0d1c1e-6a43-4f0e-9d8b-2f6f1b8c4a10")
STUDIO_PORTS = {1: "en5", 2: "en2", 3: "en7", 4: "en3", 5: "en6", 6: "en4"}


@dataclass(frozen=True)
class Model:
    name: str
    identifier: str  # its model identifier, as a peer's entry names it
    thunderbolt: str  # fixture file names
    ibv_devices: str
    networksetup: str | None  # None: derived from STUDIO_PORTS
    os_version: str


STUDIO = Model(
    "Mac Studio",
    "Mac15,14",
    TB_STUDIO,
    IBV_STUDIO,
    None,
    "26.2",
)
MACBOOK = Model(
    "MacBook Pro",
    "Mac17,6",
    TB_ON,
    IBV_MBP,
    NS_OSAURUS,
    "27.0",
)


def port_uuid(node: str, receptacle: int) -> str:
    return str(uuid.uuid5(_UUIDS, f"{node}/{receptacle}")).upper()


def _receptacle(bus: dict[str, Any]) -> int:
    return int(bus["receptacle_1_tag"]["receptacle_id_key"])


def _networksetup(model: Model) -> str:
    if model.networksetup is not None:
        return read_fixture(model.networksetup)
    head = read_fixture(MACBOOK.networksetup or "").split("\n\n")[0]  # its Ethernet block
    blocks = [head, "Hardware Port: Thunderbolt Bridge\nDevice: bridge0\nEthernet Address: N/A"]
    blocks += [
        f"Hardware Port: Thunderbolt {n}\nDevice: {en}\nEthernet Address: N/A"
        for n, en in STUDIO_PORTS.items()
    ]
    return "\n\n".join(blocks) + "\n\nVLAN Configurations\n===================\n"


def _devinfo(devices: Sequence[str], active: set[str]) -> str:
    block = read_fixture(DEVINFO_DOWN).split("\n\n")[0]
    assert block.startswith("hca_id:\trdma_en1") and "PORT_DOWN (1)" in block
    out = []
    for device in devices:
        text = block.replace("hca_id:\trdma_en1", f"hca_id:\t{device}")
        if device in active:
            text = text.replace("PORT_DOWN (1)", "PORT_ACTIVE (4)")
        out.append(text)
    return "\n\n".join(out) + "\n"


def mesh(
    model: Model,
    names: Sequence[str],
    missing: Iterable[tuple[str, str]] = (),
    down: Iterable[tuple[str, str]] = (),
    doubled: Iterable[tuple[str, str]] = (),
    ifconfig: Mapping[str, str] | None = None,
) -> dict[str, dict[str, str]]:
    """Each node's recorded outputs (replay file name -> text) for `names` cabled into
    a full mesh, except the `missing` pairs; `down` names (node, rdma device) whose port
    is PORT_DOWN although cabled; `doubled` pairs have a second cable, crossed (the first
    port of one end joins the second port of the other); `ifconfig` gives nodes a
    recorded `ifconfig` output (else none is recorded: the command failed)."""
    cut = {frozenset(p) for p in missing}
    downs = set(down)
    twice = {frozenset(p) for p in doubled}
    doc = json.loads(read_fixture(model.thunderbolt))
    buses = doc["SPThunderboltDataType"]
    peer_bus = next(b for b in buses if any("domain_uuid_key" in i for i in b.get("_items", [])))
    peer_entry = next(i for i in peer_bus["_items"] if "domain_uuid_key" in i)
    idle_tag = next(b for b in buses if "_items" not in b)["receptacle_1_tag"]
    free = sorted(
        _receptacle(b)
        for b in buses
        if not [i for i in b.get("_items", []) if "domain_uuid_key" not in i]
    )
    pairs = [p for p in itertools.combinations(names, 2) if frozenset(p) not in cut]
    pairs += [p for p in itertools.combinations(names, 2) if frozenset(p) in twice]
    ends: dict[tuple[str, str], list[int]] = {}
    for k, node in enumerate(names):
        peers = [b if a == node else a for a, b in pairs if node in (a, b)]
        if len(peers) > len(free):
            raise ValueError(f"a {model.name} has {len(free)} free ports, not {len(peers)}")
        # Each node cabled from another free port on: rows of the matrix then differ.
        turned = free[k % len(free) :] + free[: k % len(free)]
        for peer, r in zip(peers, turned, strict=False):
            ends.setdefault((node, peer), []).append(r)
    # Cable i of a pair joins the i-th port of its first node to the i-th of the second
    # (the second's list reversed when doubled: the cables cross).
    cable: dict[tuple[str, int], tuple[str, int]] = {}
    for a, b in {(a, b) for a, b in pairs}:
        there = ends[(b, a)][::-1] if frozenset((a, b)) in twice else ends[(b, a)]
        for ra, rb in zip(ends[(a, b)], there, strict=True):
            cable[(a, ra)], cable[(b, rb)] = (b, rb), (a, ra)
    hardware = _networksetup(model)
    ifaces = thunderbolt_ports(parse_networksetup_ports(hardware))
    devices = [
        line.split()[0] for line in read_fixture(model.ibv_devices).splitlines()[2:] if line.strip()
    ]
    out: dict[str, dict[str, str]] = {}
    for node in names:
        mine = copy.deepcopy(doc)
        active: set[str] = set()
        for bus in mine["SPThunderboltDataType"]:
            r = _receptacle(bus)
            bus["domain_uuid_key"] = port_uuid(node, r)
            items = [i for i in bus.get("_items", []) if "domain_uuid_key" not in i]
            far = cable.get((node, r))
            if not items:  # the port's state as recorded with a Mac on it, or idle
                tag = peer_bus if far is not None else {"receptacle_1_tag": idle_tag}
                bus["receptacle_1_tag"] = {
                    **copy.deepcopy(tag["receptacle_1_tag"]),
                    "receptacle_id_key": str(r),
                }
            if far is not None:
                entry = copy.deepcopy(peer_entry)
                entry["domain_uuid_key"] = port_uuid(*far)
                entry["_name"], entry["device_name_key"] = model.name, model.identifier
                items.append(entry)
                device = f"rdma_{ifaces[r]}"
                if (node, device) not in downs and (far[0], f"rdma_{ifaces[far[1]]}") not in downs:
                    active.add(device)
            if items:
                bus["_items"] = items
            else:
                bus.pop("_items", None)
        files = {
            ("system_profiler", "SPThunderboltDataType", "-json"): json.dumps(mine, indent=2),
            ("networksetup", "-listallhardwareports"): hardware,
            ("ibv_devices",): read_fixture(model.ibv_devices),
            ("ibv_devinfo",): _devinfo(devices, active),
            ("rdma_ctl", "status"): read_fixture(RDMA_CTL),
            ("sw_vers", "-productVersion"): model.os_version + "\n",
        }
        if ifconfig and node in ifconfig:
            files[("ifconfig",)] = read_fixture(ifconfig[node])
        out[node] = {node_probe.replay_name(argv): text for argv, text in files.items()}
    return out


def replay(folder: Path, outputs: Mapping[str, str]) -> Path:
    """Write one node's outputs where its agent replays them from."""
    where = folder / node_probe.REPLAY_FOLDER
    where.mkdir(parents=True, exist_ok=True)
    for name, text in outputs.items():
        (where / name).write_text(text, encoding="utf-8")
    return where


def facts(outputs: Mapping[str, Mapping[str, str]], tmp: Path) -> dict[str, dict[str, Any]]:
    """Each node's `facts["rdma"]` as its agent would report it from these outputs."""
    return {
        node: node_probe.rdma_facts(replay(tmp / node, files)) for node, files in outputs.items()
    }
