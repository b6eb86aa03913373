"""The cluster's CURVE keys, made by the controller and installed on every node.

The controller has its own keypair and one per node (under STUDIOTUI_HOME/keys).
A node gets its own keypair plus the public keys of the controller and of every
other node: shards of one placement connect to each other, and every server
socket accepts only authorized keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker.shared.protocol import curve
from worker.shared.protocol.curve import CurveKeys

AUTHORIZED = "keys/authorized/"


@dataclass(frozen=True)
class NodeKeyFiles:
    """What goes into a node's work dir: relative path -> (bytes, mode)."""

    files: dict[str, bytes]


def controller_keys(home: Path) -> CurveKeys:
    return curve.ensure_keypair(curve.key_dir(home), "self")


def node_keys(home: Path, node: str) -> CurveKeys:
    return curve.ensure_keypair(curve.key_dir(home) / "nodes", node)


def node_public_key(home: Path, node: str) -> bytes:
    return node_keys(home, node).public


def node_key_files(home: Path, node: str, all_nodes: list[str]) -> NodeKeyFiles:
    own_dir = curve.key_dir(home) / "nodes"
    node_keys(home, node)
    controller_keys(home)
    files = {
        "keys/self.key": (own_dir / f"{node}.key").read_bytes(),
        "keys/self.key_secret": (own_dir / f"{node}.key_secret").read_bytes(),
        "keys/authorized/controller.key": (curve.key_dir(home) / "self.key").read_bytes(),
    }
    for peer in all_nodes:
        node_keys(home, peer)
        files[f"keys/authorized/{peer}.key"] = (own_dir / f"{peer}.key").read_bytes()
    return NodeKeyFiles(files=files)


def authorized_names(bundle: NodeKeyFiles) -> list[str]:
    """The file names under keys/authorized/ a node should have: any other is revoked."""
    return sorted(rel.split("/")[-1] for rel in bundle.files if rel.startswith(AUTHORIZED))


def install_locally(workdir: Path, bundle: NodeKeyFiles) -> None:
    for rel, data in bundle.files.items():
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        path.write_bytes(data)
        path.chmod(0o600)
    # A node removed from the inventory loses its access here; the agent and its
    # shards notice the change on disk and reload their keys (worker/protocol/curve.py).
    keep = set(authorized_names(bundle))
    for old in (workdir / AUTHORIZED).glob("*.key"):
        if old.name not in keep:
            old.unlink()
