"""`studiotui` with no verb: find (or make) a cluster and open the dashboard.

The slow parts of a first run (starting agents, writing the demo model, placing
it) happen inside the app, in a worker, so the dashboard appears at once and
shows them as they go. Agents are detached daemons: quitting the app leaves them
running for the next start (`studiotui down` stops them).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from studiotui.app.app import ServiceStarter, Startup, StudioApp
from studiotui.cluster import local_cluster
from studiotui.cluster.session import load_cluster
from studiotui.core.errors import UserError
from studiotui.core.inventory import (
    DEFAULT_CONTROL_PORT,
    LOCAL_BASE_OCTET,
    Inventory,
    choose_local_layout,
    find_inventory,
    local_inventory,
)

LOCAL_NODES = 4
WEB_PARENT_VAR = "STUDIOTUI_WEB_PARENT"  # set by `studiotui web` (cli/web.py PARENT_VAR)
LOCAL_MEMORY_GB = 16.0


def free_local_base(
    n: int, control_port: int = DEFAULT_CONTROL_PORT, first: int = LOCAL_BASE_OCTET
) -> int:
    """The first loopback range 127.0.0.B… (Linux) whose agent ports are all free."""
    try:
        layout = choose_local_layout(n, "linux", local_cluster.port_free, control_port, first)
        return layout.base_octet
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc


def where(inventory: Inventory) -> str:
    """The simulated nodes' addresses, short: a range of addresses or of ports."""
    first, last = inventory.nodes[0], inventory.nodes[-1]
    if first.address == last.address:
        return f"{first.address} ports {first.control_port}–{last.control_port}"
    return f"{first.address}–{last.address.rsplit('.', 1)[-1]}"


def first_run(
    home: Path,
    n: int | None = None,
    memory_gb: float = LOCAL_MEMORY_GB,
    platform: str = sys.platform,
) -> tuple[Inventory, Startup]:
    """A new simulated cluster here, with the demo model placed on it."""
    n = n or LOCAL_NODES
    try:
        layout = choose_local_layout(n, platform, local_cluster.port_free)
    except ValueError as exc:
        raise UserError(f"{exc}; stop another simulated cluster (studiotui down)") from exc
    inventory = local_inventory(
        n,
        home=home,
        memory_gb=memory_gb,
        base_octet=layout.base_octet,
        control_port=layout.control_port,
        platform=platform,
    )
    local_cluster.save_local_inventory(home, inventory)
    note = (
        f"no cluster.toml found: starting a simulated cluster of {n} nodes on "
        f"{where(inventory)} and placing the demo model (`studiotui down` stops it)"
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


def build_app(
    args: argparse.Namespace,
    home: Path,
    services: Sequence[ServiceStarter] = (),
    platform: str = sys.platform,
) -> StudioApp:
    """The dashboard `studiotui` opens: on a cluster.toml if one is found, else on a
    new simulated cluster (the first run)."""
    explicit = getattr(args, "inventory", None)
    found = find_inventory(explicit, Path.cwd(), home)
    if found is None and not local_cluster.local_inventory_path(home).exists():
        inventory, startup = first_run(home, platform=platform)
    else:
        inventory = load_cluster(
            args.inventory, home, trust=getattr(args, "trust_inventory", False)
        )
        startup = existing(inventory)
    return StudioApp(home, inventory, startup=startup, services=services)


def end_with_parent(parent: int) -> None:
    """A browser tab's dashboard (`studiotui web`) ends if `web` goes without ending it
    (killed hard): a thread, since the app's own loop may be too busy to hear."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="web-parent", daemon=True).start()


def launch(args: argparse.Namespace, home: Path, services: Sequence[ServiceStarter] = ()) -> int:
    parent = os.environ.get(WEB_PARENT_VAR, "")
    app = build_app(args, home, services)
    if parent.isdigit():
        end_with_parent(int(parent))
        # A browser tab never starts an agent `down` stopped, whenever that was: the
        # operator stopped it, and a tab opens (and reopens) without being asked.
        app.started_at = 0.0
    app.run()
    if app.exit_note:
        print(app.exit_note)
    return app.return_code or 0
