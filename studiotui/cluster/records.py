"""The files the controller keeps under STUDIOTUI_HOME, one set per cluster, so that a
restarted TUI or CLI (or another one running beside it) knows what this one did:

- `placements-<cluster>.json`: the ring each placement was planned on, until unloaded;
- `links-<cluster>.json`: the last link measurement;
- `stopped-shards-<cluster>.json`: the shards `down` took off nodes, for `restart`;
- `loaded-shards-<cluster>.json`: every shard of each placement as it became ready.

Each file is replaced whole, so a reader in another process never sees half of it.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from studiotui.core.state import LinkState, PlannedPlacement
from worker.shared.protocol import control, messages


@dataclass(frozen=True)
class SavedShard:
    """A shard as its agent reported it before a restart, and where its ring goes on,
    enough to load it again in the same place (node, layers, ports)."""

    node: str
    placement: str
    report: control.ShardReport
    next_endpoint: str
    next_key: str


def saved_row(k: SavedShard) -> dict[str, Any]:
    """A saved shard as the files that keep them write it (`kept_shards`, `recorded`)."""
    return {
        "node": k.node,
        "placement": k.placement,
        "report": control.to_wire(k.report),
        "next_endpoint": k.next_endpoint,
        "next_key": k.next_key,
    }


def saved_from_row(row: Any) -> SavedShard:
    """Raises ValueError, TypeError, KeyError or MessageError for anything else."""
    return SavedShard(
        node=str(row["node"]),
        placement=str(row["placement"]),
        report=control.parse(row["report"], control.ShardReport),
        next_endpoint=str(row["next_endpoint"]),
        next_key=str(row["next_key"]),
    )


def write_json(path: Path, data: Any) -> bool:
    """Replace `path` whole (a reader in another process never sees half of it); False
    when it could not be written (the state goes on in memory)."""
    try:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        return False
    return True


class Records:
    """The files of cluster `cluster` under `home`."""

    def __init__(self, home: Path, cluster: str) -> None:
        self.home = home
        self.cluster = cluster

    # ---- planned rings ---------------------------------------------------------------------

    @property
    def planned_file(self) -> Path:
        return self.home / f"placements-{self.cluster}.json"

    def planned_stamp(self) -> int:
        try:
            return self.planned_file.stat().st_mtime_ns
        except OSError:
            return 0  # none saved yet

    def read_planned(self) -> dict[str, PlannedPlacement]:
        try:
            raw = json.loads(self.planned_file.read_text())
            return {str(k): PlannedPlacement.from_json(v) for k, v in raw.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}  # none saved yet, or damaged: placements show as reported

    def write_planned(self, planned: dict[str, PlannedPlacement]) -> bool:
        return write_json(self.planned_file, {k: v.to_json() for k, v in planned.items()})

    # ---- links -----------------------------------------------------------------------------

    @property
    def links_file(self) -> Path:
        return self.home / f"links-{self.cluster}.json"

    def save_links(self, links: tuple[LinkState, ...]) -> None:
        """Keep the last measurement, so a restarted TUI or CLI plans with it."""
        with contextlib.suppress(OSError):
            self.links_file.write_text(json.dumps([asdict(x) for x in links]))

    def load_links(self, names: Iterable[str]) -> tuple[LinkState, ...]:
        """The last measurement's links between nodes among `names` (the inventory's)."""
        known = set(names)
        try:
            raw = json.loads(self.links_file.read_text())
            links = tuple(LinkState(**x) for x in raw)
        except (OSError, ValueError, TypeError):
            return ()
        return tuple(x for x in links if x.a in known and x.b in known)

    # ---- shards kept by `down`, shards recorded when placed -----------------------------------

    @property
    def kept_file(self) -> Path:
        return self.home / f"stopped-shards-{self.cluster}.json"

    def read_kept(self) -> list[SavedShard]:
        """Shards `down` took off nodes, of placements still planned."""
        try:
            kept = [saved_from_row(row) for row in json.loads(self.kept_file.read_text())]
        except (OSError, ValueError, TypeError, KeyError, messages.MessageError):
            return []  # none kept, or damaged: restart reloads what the agents report
        planned = self.read_planned()
        return [k for k in kept if k.placement in planned]

    def write_kept(self, kept: Sequence[SavedShard]) -> None:
        write_json(self.kept_file, [saved_row(k) for k in kept])

    @property
    def recorded_file(self) -> Path:
        return self.home / f"loaded-shards-{self.cluster}.json"

    def read_recorded(self) -> list[SavedShard]:
        """Every shard of each planned placement as it was when it became ready."""
        try:
            raw = json.loads(self.recorded_file.read_text())
            recorded = [saved_from_row(row) for rows in raw.values() for row in rows]
        except (OSError, ValueError, TypeError, KeyError, AttributeError, messages.MessageError):
            return []  # none recorded (placed by an older build), or damaged
        planned = self.read_planned()
        return [r for r in recorded if r.placement in planned]

    def write_recorded(self, name: str, saved: Sequence[SavedShard]) -> None:
        """Replace what is recorded for placement `name` (nothing: forget it)."""
        try:
            raw = json.loads(self.recorded_file.read_text())
            rows = {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
        except (OSError, ValueError):
            rows = {}
        rows.pop(name, None)
        if saved:
            rows[name] = [saved_row(s) for s in saved]
        write_json(self.recorded_file, rows)
