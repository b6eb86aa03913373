"""What the global options mean: the parsed command line turned into the layers' terms."""

from __future__ import annotations

import argparse
from pathlib import Path

from studiotui.cluster.session import load_cluster
from studiotui.core.errors import UserError
from studiotui.core.inventory import Inventory, SelectionError, resolve_group


def inventory_of(args: argparse.Namespace, home: Path) -> Inventory:
    """The cluster `-i` / ./cluster.toml / $STUDIOTUI_HOME names, as `--trust-inventory` allows."""
    return load_cluster(args.inventory, home, trust=getattr(args, "trust_inventory", False))


def nodes_of(args: argparse.Namespace, inv: Inventory) -> list[str] | None:
    """The nodes `--nodes` names (node names or a group of the inventory), None when it
    names none; a name the inventory lacks is the user's mistake, said as such."""
    if not args.nodes:
        return None
    try:
        return list(resolve_group(inv, args.nodes))
    except SelectionError as exc:
        raise UserError(str(exc)) from None
