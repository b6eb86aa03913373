"""Whether an inventory found in the current directory may run programs on this machine.

A `cluster.toml` in the directory a command runs from may have come with a cloned
repository or a download. Its local nodes decide which interpreter studiotui starts
here and which directory it writes keys to and deletes builds from; unless they are
studiotui's own, the operator has to say the file is trusted. Pure: the caller reads
files and prints.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from studiotui.core.inventory import Inventory


def inventory_doubts(inventory: Inventory, home: Path, own_python: str) -> list[str]:
    """Why the local nodes of `inventory` are not studiotui's own, one line each."""
    doubts = []
    ours = Path(own_python).resolve()
    home = home.expanduser().resolve()
    for node in inventory.nodes:
        if not node.is_local:
            continue
        python = Path(node.python).expanduser()
        # A relative name (the default "python3") is never run for a local node: the
        # agent runs on studiotui's own interpreter then (local_cluster.start_agent).
        if python.is_absolute() and python.resolve() != ours:
            doubts.append(f"{node.name} would run {node.python}, not studiotui's python {ours}")
        workdir = Path(node.workdir).expanduser().resolve()
        if not workdir.is_relative_to(home):
            doubts.append(f"{node.name} would write to {workdir}, outside {home}")
    return doubts


# In STUDIOTUI_HOME: a random token. A node whose workdir holds the same token is this
# home reached over SSH (or through a shared home directory), which a node must not use.
HOME_MARK = ".studiotui-home"


def home_mark(home: Path) -> str:
    """The token of this STUDIOTUI_HOME, made (mode 0600) the first time it is asked for."""
    path = home / HOME_MARK
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
