"""Which nodes `studiotui down` stopped, and when: a small file per cluster in the home.

An open dashboard sees a node stopped from another terminal fall silent like one that
died; the record lets it say the operator stopped it (not "silent … restart it"), and a
dashboard that started before the `down` (a browser tab still starting) leaves the
agent stopped instead of starting it again.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

# A node's last telemetry can come a little after `down` wrote its record (the agent
# was asked to stop after the record was written): a record this much older than the
# last word still counts.
SLACK_S = 2.0


def stops_file(home: Path, cluster: str) -> Path:
    return home / f"stopped-nodes-{cluster}.json"


def read_stops(home: Path, cluster: str) -> dict[str, float]:
    """Node -> when `down` stopped it (Unix seconds); {} when none is recorded."""
    try:
        raw = json.loads(stops_file(home, cluster).read_text())
        return {str(k): float(v) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def record_stops(home: Path, cluster: str, nodes: Sequence[str], when: float | None = None) -> None:
    """Say that `down` stopped `nodes` now (or at `when`)."""
    _write(
        home, cluster, {**read_stops(home, cluster), **dict.fromkeys(nodes, when or time.time())}
    )


def forget_stops(home: Path, cluster: str, nodes: Sequence[str]) -> None:
    """`nodes` are started again (up, restart, the dashboard's start)."""
    stops = read_stops(home, cluster)
    if any(n in stops for n in nodes):
        _write(home, cluster, {k: v for k, v in stops.items() if k not in nodes})


def stopped_at(stops: Mapping[str, float], node: str, last_seen: float) -> float | None:
    """When `down` stopped `node`, if that is what silenced it: a stop recorded after
    (or just before) the last word heard from it; None for a node that fell silent on
    its own (a crash, a network cut) or was started again since."""
    when = stops.get(node)
    return when if when is not None and when >= last_seen - SLACK_S else None


def stopped_since(stops: Mapping[str, float], node: str, started: float) -> float | None:
    """When `down` stopped `node` after `started` (a dashboard's start), else None."""
    when = stops.get(node)
    return when if when is not None and when >= started else None


def _write(home: Path, cluster: str, stops: Mapping[str, float]) -> None:
    path = stops_file(home, cluster)
    with contextlib.suppress(OSError):
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(dict(stops)))
        tmp.replace(path)
