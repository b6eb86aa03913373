"""Reaching a node over SSH: its target (user, host, port, key), a connection that checks
host keys against ours and the user's known_hosts, and remote path spelling for SFTP."""

from __future__ import annotations

import contextlib
import getpass
import os
import tempfile
from pathlib import Path

import asyncssh

from studiotui.core.inventory import NodeSpec
from studiotui.ssh import client as ssh

USER_KNOWN_HOSTS = Path("~/.ssh/known_hosts")


def sftp_path(path: str) -> str:
    """SFTP resolves relative paths from the login's home, which is what `~/` means."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def remote_join(workdir: str, *parts: str) -> str:
    return "/".join([workdir.rstrip("/") or "/", *parts])


# --------------------------------------------------------------------------- connecting


def ssh_target(node: NodeSpec, known_hosts: Path) -> ssh.SshTarget:
    user = node.user
    if not user:
        with contextlib.suppress(KeyError, OSError):
            user = getpass.getuser()
    return ssh.SshTarget(
        host=node.hostname or node.ssh_host,
        port=node.port or 22,
        user=user or "root",
        identity=node.identity,
        known_hosts=known_hosts,
        node=node.name,
    )


def _count_lines(text: str) -> int:
    return len(text.splitlines())


async def connect_node(
    node: NodeSpec,
    home: Path,
    *,
    accept_new_host_keys: bool = False,
    timeout: float = 10.0,
    user_known_hosts: Path | None = USER_KNOWN_HOSTS,
) -> asyncssh.SSHClientConnection:
    """Connect trusting keys in home/known_hosts and, read-only, ~/.ssh/known_hosts.

    A node the operator has already reached with plain `ssh` is trusted without
    asking again. New keys (with `accept_new_host_keys`) go to our file only;
    the user's file is never written.
    """
    ours = home / "known_hosts"
    theirs = user_known_hosts.expanduser() if user_known_hosts is not None else None
    their_text = ""
    if theirs is not None:
        with contextlib.suppress(OSError):
            their_text = theirs.read_text(errors="replace")
    if not their_text.strip():
        return await ssh.connect(
            ssh_target(node, ours), accept_new_host_keys=accept_new_host_keys, timeout=timeout
        )
    assert theirs is not None
    our_text = ""
    with contextlib.suppress(OSError):
        our_text = ours.read_text(errors="replace")
    if our_text and not our_text.endswith("\n"):
        our_text += "\n"
    if not their_text.endswith("\n"):
        their_text += "\n"
    merged_text = our_text + their_text
    home.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".known_hosts-", dir=home)
    merged = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(merged_text)
        try:
            conn = await ssh.connect(
                ssh_target(node, merged),
                accept_new_host_keys=accept_new_host_keys,
                timeout=timeout,
            )
        except ssh.UnknownHostKey as exc:
            where = f"{ours} (nor in {theirs})"
            raise ssh.UnknownHostKey(
                exc.node,
                exc.message.replace(str(merged), where),
                exc.hint.replace(str(merged), str(ours)),
                exc.fingerprint,
            ) from None
        except ssh.ChangedHostKey as exc:
            raise _changed_in(exc, merged, ours, theirs, _count_lines(our_text)) from None
        except ssh.SshError as exc:
            exc.message = exc.message.replace(str(merged), str(ours))
            exc.hint = exc.hint.replace(str(merged), str(ours))
            raise
        added = merged.read_text(errors="replace")[len(merged_text) :]
        if added.strip():
            ours.parent.mkdir(parents=True, exist_ok=True)
            with open(ours, "a") as f:
                f.write(("" if not our_text or our_text.endswith("\n") else "\n") + added)
            with contextlib.suppress(OSError):
                ours.chmod(0o600)
        return conn
    finally:
        merged.unlink(missing_ok=True)


def _changed_in(
    exc: ssh.ChangedHostKey, merged: Path, ours: Path, theirs: Path, ours_lines: int
) -> ssh.ChangedHostKey:
    """Re-point a changed-key error at the real file and line the stale key is on."""
    places = []
    lines = []
    for number, text in exc.known_hosts_lines:
        if number <= ours_lines:
            places.append(f"{ours} line {number}")
            lines.append((number, text))
        else:
            places.append(f"{theirs} line {number - ours_lines}")
            lines.append((number - ours_lines, text))
    message = exc.message.replace(str(merged), str(ours))
    pattern = exc.hint.split("ssh-keygen -R '", 1)[-1].split("'", 1)[0]
    files = sorted({p.rsplit(" line ", 1)[0] for p in places}) or [str(ours)]
    commands = " and ".join(f"`ssh-keygen -R '{pattern}' -f {f}`" for f in files)
    hint = (
        f"If the change is expected, remove the old key ({'; '.join(places) or 'its entry'}), "
        f"e.g. {commands}, then re-run with {ssh.ACCEPT_FLAG}."
    )
    return ssh.ChangedHostKey(exc.node, message, hint, exc.expected, exc.offered, lines)


# --------------------------------------------------------------------------- small remote calls
