"""Opening the cluster a command or the dashboard works on: find the inventory, open a
controller (every CLI verb through `open_controller`), wait for agents. Shared by the
CLI, the dashboard and the benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller
from studiotui.core.errors import UserError
from studiotui.core.inventory import Inventory, InventoryError, find_inventory, load_inventory
from studiotui.core.trust import inventory_doubts


def load_cluster(inventory: Path | None, home: Path, *, trust: bool = False) -> Inventory:
    """The inventory named by `-i`, else ./cluster.toml, $STUDIOTUI_HOME, the local cluster.

    A ./cluster.toml whose local nodes are not studiotui's own needs `trust`
    (--trust-inventory); the path used is always printed."""
    path = find_inventory(inventory, Path.cwd(), home)
    if path is None:
        path = local_cluster.local_inventory_path(home)
        if not path.exists():
            raise UserError(
                "no cluster.toml found (looked in -i, ./cluster.toml, $STUDIOTUI_HOME) and no "
                "local cluster",
                "run `studiotui up --local 4` or write a cluster.toml",
            )
    if not path.exists():
        raise UserError(f"inventory {path} does not exist")
    try:
        inv = load_inventory(path)
    except InventoryError as exc:
        raise UserError(str(exc)) from None
    # Which cluster a command acts on is never a guess: the file is always named.
    print(f"studiotui: inventory {path}", file=sys.stderr)
    if inventory is None and path.parent.resolve() == Path.cwd().resolve():
        doubts = inventory_doubts(inv, home, sys.executable)
        if doubts and not trust:
            lines = "\n  ".join(doubts)
            raise UserError(
                f"{path} is in the current directory and its local nodes are not studiotui's "
                f"own:\n  {lines}",
                "if you trust this file, rerun with --trust-inventory (or name it with -i)",
            )
    return inv


@contextlib.asynccontextmanager
async def open_controller(
    inv: Inventory, home: Path, *, ask: float | None = 2.0, telemetry: bool = False
) -> AsyncIterator[Controller]:
    """A controller on `inv` for one command, its sockets closed when the block ends
    (however it ends). `ask`: how long the agents get to say who they are and what they
    run before the block starts (`refresh`); None: not asked (the verb asks when it
    needs to, or never: `down`, `logs`). `telemetry`: follow the agents' telemetry too,
    for a long-lived command (`serve`)."""
    ctl = Controller(home, inv)
    try:
        if telemetry:
            await ctl.start(telemetry=True)
        elif ask is not None:
            await ctl.refresh(timeout=ask)
        yield ctl
    finally:
        await ctl.close()


async def wait_until_up(ctl: Controller, names: list[str], timeout: float) -> list[str]:
    """The names among `names` still not up after `timeout` seconds (empty when all are)."""
    deadline = time.monotonic() + timeout
    while True:
        await ctl.refresh(timeout=1.0)
        missing = [n for n in names if (s := ctl.state.node(n)) is None or s.state != "up"]
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.2)
