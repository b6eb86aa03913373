"""`studiotui` with no verb: find (or make) a cluster and open the dashboard.

The slow parts of a first run (starting agents, writing the demo model, placing
it) happen inside the app, in a worker, so the dashboard appears at once and
shows them as they go. Agents are detached daemons: quitting the app leaves them
running for the next start (`studiotui down` stops them).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
from pathlib import Path

from studiotui import local_cluster
from studiotui.app.app import Startup, StudioApp
from studiotui.inventory import (
    DEFAULT_CONTROL_PORT,
    TELEMETRY_PORT_OFFSET,
    Inventory,
    dump_inventory,
    find_inventory,
    local_inventory,
)

LOCAL_NODES = 4
LOCAL_MEMORY_GB = 16.0
DEFAULT_BASE_OCTET = 11


def _port_free(address: str, port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_local_base(
    n: int, control_port: int = DEFAULT_CONTROL_PORT, first: int = DEFAULT_BASE_OCTET
) -> int:
    """The first loopback range 127.0.0.B… whose agent ports are all free.

    Another simulated cluster (another user, another home) may hold the default
    range; binding there would fail, so a first run steps aside by tens.
    """
    for base in range(first, 255 - n, 10):
        addresses = [f"127.0.0.{base + k}" for k in range(n)]
        ports = (control_port, control_port + TELEMETRY_PORT_OFFSET)
        if all(_port_free(a, p) for a in addresses for p in ports):
            return base
    raise RuntimeError(f"no free loopback range for {n} local nodes on port {control_port}")


def first_run(
    home: Path, n: int = LOCAL_NODES, memory_gb: float = LOCAL_MEMORY_GB
) -> tuple[Inventory, Startup]:
    """A new simulated cluster here, with the demo model placed on it."""
    base = free_local_base(n)
    if base == DEFAULT_BASE_OCTET:
        inventory = local_cluster.write_local_inventory(home, n, memory_gb)
    else:
        inventory = local_inventory(n, home=home, memory_gb=memory_gb, base_octet=base)
        path = local_cluster.local_inventory_path(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_inventory(inventory))
    first, last = inventory.nodes[0], inventory.nodes[-1]
    note = (
        f"no cluster.toml found: starting a simulated cluster of {n} nodes on "
        f"{first.address}–{last.address.rsplit('.', 1)[-1]} and placing the demo model "
        "(`studiotui down` stops it)"
    )
    return inventory, Startup(
        start_agents=list(inventory.nodes),
        demo_model=home / "models" / "demo",
        place_demo=True,
        note=note,
    )


def existing(inventory: Inventory) -> Startup:
    """A known cluster: start only the local agents that are not running."""
    stopped = [n for n in inventory.nodes if n.is_local and local_cluster.running_pid(n) is None]
    note = f"starting local agents that were not running: {', '.join(n.name for n in stopped)}"
    return Startup(start_agents=stopped, note=note if stopped else "")


def launch(args: argparse.Namespace, home: Path) -> int:
    from studiotui.commands import load_cluster

    explicit = getattr(args, "inventory", None)
    found = find_inventory(explicit, Path.cwd(), home)
    if found is None and not local_cluster.local_inventory_path(home).exists():
        inventory, startup = first_run(home)
    else:
        inventory = load_cluster(args, home)
        startup = existing(inventory)
    serve = getattr(args, "serve", None)
    app = StudioApp(
        home,
        inventory,
        startup=startup,
        serve=(serve[0], serve[1], getattr(args, "api_key", None)) if serve else None,
    )
    app.run()
    if app.exit_note:
        print(app.exit_note)
    return app.return_code or 0
