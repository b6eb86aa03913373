"""What the global options mean: the parsed command line turned into the layers' terms."""

from __future__ import annotations

import argparse
from pathlib import Path

from studiotui.cluster.session import load_cluster
from studiotui.core.inventory import Inventory


def inventory_of(args: argparse.Namespace, home: Path) -> Inventory:
    """The cluster `-i` / ./cluster.toml / $STUDIOTUI_HOME names, as `--trust-inventory` allows."""
    return load_cluster(args.inventory, home, trust=getattr(args, "trust_inventory", False))
