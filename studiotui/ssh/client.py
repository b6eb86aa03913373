"""A thin layer over asyncssh for talking to the cluster's Macs.

Everything that can go wrong while reaching a node surfaces as one exception
family, `SshError`, whose text names the node and says what to do about it,
because these messages end up in front of a person at a terminal, not in a
log.

Host keys are always checked against an explicit known_hosts file.  A host
that is not in it is refused unless the caller opts in to trust-on-first-use
(`accept_new_host_keys=True`); a host whose key *differs* from the recorded
one is refused regardless, since that is the one case where silently
proceeding would defeat the point of checking.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import secrets
import shlex
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import asyncssh

from studiotui.core.errors import StudioError

__all__ = [
    "AuthFailed",
    "ChangedHostKey",
    "Completed",
    "HostUnreachable",
    "RemoteCommandFailed",
    "RemoteCommandTimeout",
    "RemoteFileError",
    "SshError",
    "SshTarget",
    "UnknownHostKey",
    "connect",
    "get_files",
    "put_file",
    "put_files",
    "read_file_since",
    "read_file_tail",
    "run",
]

ACCEPT_FLAG = "--accept-new-host-keys"

# Lines of remote stderr kept in RemoteCommandFailed: enough to show the
# actual error, not so much that it drowns the node's status line.
STDERR_TAIL_LINES = 20

_SFTP_CHUNK = 256 * 1024
_EXTRA_NODE = "studiotui_node"


# -- errors --------------------------------------------------------------------


class SshError(StudioError):
    """Base of every failure to reach or use a node over SSH.

    `message` says what went wrong, `hint` what the user can do; `str()`
    prefixes the node name so the text stands on its own.
    """

    def __init__(self, node: str, message: str, hint: str = "") -> None:
        super().__init__(message, hint)
        self.node = node

    def __str__(self) -> str:
        text = f"{self.node}: {self.message}"
        return f"{text}\n  hint: {self.hint}" if self.hint else text


class HostUnreachable(SshError):
    """No SSH server could be reached: refused, no route, DNS, or timeout."""


class AuthFailed(SshError):
    """The server rejected every key we offered (or the key is unusable)."""


class UnknownHostKey(SshError):
    """The host has no entry in known_hosts and accepting was not requested."""

    def __init__(self, node: str, message: str, hint: str, fingerprint: str) -> None:
        super().__init__(node, message, hint)
        self.fingerprint = fingerprint


class ChangedHostKey(SshError):
    """The host offered a key different from the one recorded for it."""

    def __init__(
        self,
        node: str,
        message: str,
        hint: str,
        expected: list[str],
        offered: str,
        known_hosts_lines: list[tuple[int, str]],
    ) -> None:
        super().__init__(node, message, hint)
        self.expected = expected
        self.offered = offered
        self.known_hosts_lines = known_hosts_lines


class RemoteCommandFailed(SshError):
    """A remote command exited non-zero (or was killed by a signal)."""

    def __init__(self, node: str, argv: list[str], exit_status: int, stderr_tail: str) -> None:
        self.argv = list(argv)
        self.exit_status = exit_status
        self.stderr_tail = stderr_tail
        how = (
            f"was killed by signal {-exit_status}"
            if exit_status < 0
            else f"exited with status {exit_status}"
        )
        message = f"remote command `{shlex.join(argv)}` {how}"
        if stderr_tail:
            message += ":\n" + "\n".join("    " + line for line in stderr_tail.splitlines())
        super().__init__(node, message, "")


class RemoteCommandTimeout(SshError):
    """A remote command did not finish in time; its channel was closed."""


class RemoteFileError(SshError):
    """An SFTP operation failed (missing file, permission denied, ...)."""


# -- connecting ------------------------------------------------------------------


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to reach one node of the cluster."""

    host: str
    port: int
    user: str
    # None means the default ~/.ssh/id_* keys plus ssh-agent, like plain ssh.
    identity: str | None
    known_hosts: Path
    node: str

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def _known_hosts_pattern(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _load_known_hosts(path: Path) -> asyncssh.SSHKnownHosts:
    # A missing file just means nothing is trusted yet; asyncssh would
    # otherwise report it as an I/O error indistinguishable from a real one.
    try:
        data = path.read_text()
    except FileNotFoundError:
        data = ""
    return asyncssh.import_known_hosts(data)


def _describe_key(key: asyncssh.SSHKey) -> str:
    return f"{key.get_fingerprint('sha256')} ({key.get_algorithm()})"


def _load_identity(target: SshTarget) -> list[asyncssh.SSHKey] | None:
    if target.identity is None:
        return None
    path = os.path.expanduser(target.identity)
    try:
        return [asyncssh.read_private_key(path)]
    except FileNotFoundError:
        raise AuthFailed(
            target.node,
            f"identity file {path} does not exist",
            "Fix the node's identity in the cluster config, or create a key with "
            f"`ssh-keygen -t ed25519 -f {path}`.",
        ) from None
    except (OSError, asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:
        raise AuthFailed(
            target.node,
            f"cannot use identity file {path}: {exc}",
            "Use an unencrypted private key in OpenSSH format, or leave the identity "
            "unset to use ssh-agent.",
        ) from None


def _auth_failed(target: SshTarget, reason: str) -> AuthFailed:
    if target.identity is None:
        tried = "the default keys (~/.ssh/id_*) and ssh-agent"
        pub = "your public key (~/.ssh/id_ed25519.pub)"
    else:
        tried = f"identity {target.identity}"
        pub = f"{target.identity}.pub"
    return AuthFailed(
        target.node,
        f"authentication failed at {target.host}:{target.port} as user {target.user!r} "
        f"with {tried} ({reason})",
        f"Append {pub} to ~{target.user}/.ssh/authorized_keys on {target.node}, or fix "
        "the node's user/identity in the cluster config.",
    )


def _unreachable(target: SshTarget, reason: str) -> HostUnreachable:
    return HostUnreachable(
        target.node,
        f"cannot reach an SSH server at {target.host}:{target.port} ({reason})",
        f"Check that {target.node} is powered on and on the network, that the address "
        "is right, and that Remote Login (sshd) is enabled on it.",
    )


def _os_error_reason(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host name: {exc.strerror or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused; nothing is listening on that port"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return exc.strerror or str(exc) or type(exc).__name__


async def _resolve(host: str, port: int) -> str:
    # known_hosts entries may be recorded by IP as well as by name.
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return host
    return str(infos[0][4][0]) if infos else host


async def _fetch_host_key(
    target: SshTarget, timeout: float, algs: list[str] | None = None
) -> asyncssh.SSHKey:
    try:
        async with asyncio.timeout(timeout):
            key = await asyncssh.get_server_host_key(
                target.host,
                target.port,
                config=None,
                server_host_key_algs=algs if algs else (),
            )
    except TimeoutError:
        raise _unreachable(target, f"no SSH handshake within {timeout:g}s") from None
    except OSError as exc:
        raise _unreachable(target, _os_error_reason(exc)) from None
    except asyncssh.Error as exc:
        raise _unreachable(target, f"SSH handshake failed: {exc.reason}") from None
    if key is None:  # only for GSS key exchange, which we never enable
        raise SshError(target.node, "server presented no host key", "")
    return key


def _matching_lines(path: Path, host: str, addr: str, port: int) -> list[tuple[int, str]]:
    """(line number, text) of every known_hosts line that applies to this host."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            match = asyncssh.import_known_hosts(stripped).match(host, addr, port)
        except (ValueError, asyncssh.KeyImportError):
            continue
        if match[0]:
            found.append((number, stripped))
    return found


def _append_known_host(path: Path, host: str, port: int, key: asyncssh.SSHKey) -> None:
    # Drop the key comment: it is whatever the server's admin typed and has no
    # business in our file.
    key_text = " ".join(key.export_public_key("openssh").decode().split()[:2])
    line = f"{_known_hosts_pattern(host, port)} {key_text}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        if f.tell() > 0:
            with path.open("rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    line = "\n" + line
        f.write(line)


async def _explain_host_key_failure(
    target: SshTarget, timeout: float, accept_new: bool
) -> asyncssh.SSHKey | None:
    """Raise the right host key error, or return the key to trust on first use."""
    addr = await _resolve(target.host, target.port)
    known = _load_known_hosts(target.known_hosts)
    # A line can match both by name and by address; report each key once.
    matched = known.match(target.host, addr, target.port)[0]
    expected_keys = list({k.get_fingerprint("sha256"): k for k in matched}.values())
    pattern = _known_hosts_pattern(target.host, target.port)

    if not expected_keys:
        offered = await _fetch_host_key(target, timeout)
        if accept_new:
            return offered
        fp = _describe_key(offered)
        raise UnknownHostKey(
            target.node,
            f"host key for {pattern} is not in {target.known_hosts}; the server offered {fp}",
            f"If {fp} is {target.node}'s key (check with `ssh-keygen -lf "
            "/etc/ssh/ssh_host_ed25519_key.pub` on it), re-run with "
            f"{ACCEPT_FLAG} to trust it.",
            offered.get_fingerprint("sha256"),
        )

    # Ask for the same key types we have on record so we compare like with
    # like: a server with both RSA and ed25519 keys is not "changed" just
    # because it would prefer the other one.
    algs = sorted({alg.decode() for key in expected_keys for alg in key.sig_algorithms})
    offered = await _fetch_host_key(target, timeout, algs)
    offered_fp = offered.get_fingerprint("sha256")
    expected_fps = [key.get_fingerprint("sha256") for key in expected_keys]
    if offered_fp in expected_fps:
        # The key is the recorded one, so verification failed for another
        # reason (e.g. a @revoked line); don't dress that up as a change.
        raise SshError(
            target.node,
            f"host key {_describe_key(offered)} for {pattern} was rejected by {target.known_hosts}",
            "Check that file for a @revoked or @cert-authority entry for this host.",
        )
    lines = _matching_lines(target.known_hosts, target.host, addr, target.port)
    where = "; ".join(f"line {n}: {text}" for n, text in lines) or f"entries for {pattern}"
    raise ChangedHostKey(
        target.node,
        f"HOST KEY CHANGED for {pattern}: expected "
        f"{', '.join(_describe_key(k) for k in expected_keys)} but the server offered "
        f"{_describe_key(offered)}. Refusing to connect: the machine may have been "
        "reinstalled, or someone may be intercepting the connection.",
        f"If the change is expected, remove from {target.known_hosts} {where} "
        f"(e.g. `ssh-keygen -R '{pattern}' -f {target.known_hosts}`), then re-run "
        f"with {ACCEPT_FLAG}.",
        expected_fps,
        offered_fp,
        lines,
    )


async def _open(
    target: SshTarget, client_keys: list[asyncssh.SSHKey] | None, timeout: float
) -> asyncssh.SSHClientConnection:
    # An explicit identity means exactly that key, like IdentitiesOnly:
    # offering agent keys first can exhaust the server's MaxAuthTries.  `()`
    # is asyncssh's "use the default" (~/.ssh/id_* and the agent).
    explicit = client_keys is not None
    # asyncio.timeout is the hard bound; connect_timeout lets asyncssh tidy
    # up its own half-open connection when it fires first.
    async with asyncio.timeout(timeout):
        return await asyncssh.connect(
            target.host,
            target.port,
            username=target.user,
            known_hosts=_load_known_hosts(target.known_hosts),
            client_keys=client_keys if explicit else (),
            agent_path=None if explicit else (),
            # The cluster config is the single source of truth; a stray
            # ~/.ssh/config Host block must not redirect a node.
            config=None,
            preferred_auth="publickey",
            connect_timeout=timeout,
            # Worker connections live long; notice a sleeping or unplugged Mac.
            keepalive_interval=15,
            keepalive_count_max=3,
        )


async def connect(
    target: SshTarget, *, accept_new_host_keys: bool = False, timeout: float = 10.0
) -> asyncssh.SSHClientConnection:
    """Open an authenticated connection to `target`, verifying its host key.

    Each network step is bounded by `timeout`, so a dead or silent host fails
    with HostUnreachable instead of hanging (accepting a new key takes up to
    three handshakes, each bounded).  With `accept_new_host_keys` an
    unknown host's key is appended to `target.known_hosts`; a changed key is
    always refused.
    """
    client_keys = _load_identity(target)
    for attempt in range(2):
        try:
            conn = await _open(target, client_keys, timeout)
        except asyncssh.HostKeyNotVerifiable:
            if attempt:
                # We just recorded the key, so the server swapped keys between
                # our two handshakes: explain as a change, never retry again.
                await _explain_host_key_failure(target, timeout, accept_new=False)
                raise SshError(
                    target.node,
                    "host key still not accepted after recording it",
                    f"Inspect {target.known_hosts} for conflicting entries.",
                ) from None
            offered = await _explain_host_key_failure(target, timeout, accept_new_host_keys)
            assert offered is not None
            _append_known_host(target.known_hosts, target.host, target.port, offered)
            continue
        except asyncssh.PermissionDenied as exc:
            raise _auth_failed(target, exc.reason) from None
        except TimeoutError:
            raise _unreachable(target, f"no SSH handshake within {timeout:g}s") from None
        except OSError as exc:
            raise _unreachable(target, _os_error_reason(exc)) from None
        except asyncssh.ConnectionLost as exc:
            raise _unreachable(
                target, f"connection closed during the SSH handshake: {exc.reason}"
            ) from None
        except asyncssh.Error as exc:
            raise SshError(
                target.node,
                f"SSH connection to {target.host}:{target.port} failed: {exc.reason}",
                f"Check sshd on {target.node} (its log: `log show --predicate "
                "'process == \"sshd\"' --last 5m` on macOS).",
            ) from None
        conn.set_extra_info(**{_EXTRA_NODE: target.node})
        return conn
    raise AssertionError("unreachable")  # pragma: no cover


def _node(conn: asyncssh.SSHClientConnection) -> str:
    node = conn.get_extra_info(_EXTRA_NODE)
    if node:
        return str(node)
    peer = conn.get_extra_info("peername")
    return str(peer[0]) if peer else "?"


# -- commands --------------------------------------------------------------------


@dataclass(frozen=True)
class Completed:
    # Negative when the command was killed by a signal (like subprocess).
    exit_status: int
    stdout: str
    stderr: str


def _tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _as_text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data


async def run(
    conn: asyncssh.SSHClientConnection,
    argv: list[str],
    *,
    timeout: float | None = 60.0,
    check: bool = True,
    input: str | None = None,
) -> Completed:
    """Run `argv` on the node; every argument reaches the program verbatim.

    sshd hands the command string to the user's login shell, so each argument
    is shell-quoted: spaces, quotes and `$HOME` arrive literally.
    """
    if not argv:
        raise ValueError("argv must not be empty")
    node = _node(conn)
    command = shlex.join(argv)
    try:
        result = await conn.run(command, check=False, input=input, timeout=timeout)
    except asyncssh.TimeoutError as exc:
        raise RemoteCommandTimeout(
            node,
            f"remote command `{command}` did not finish within {timeout:g}s",
            f"stderr so far: {_tail(_as_text(exc.stderr), 5)!r}" if exc.stderr else "",
        ) from None
    except (asyncssh.Error, OSError) as exc:
        reason = exc.reason if isinstance(exc, asyncssh.Error) else str(exc)
        raise SshError(
            node,
            f"lost the SSH connection while running `{command}`: {reason}",
            "Reconnect; if it keeps happening check the node's network and sleep settings.",
        ) from None
    status = result.returncode if result.returncode is not None else -1
    completed = Completed(status, _as_text(result.stdout), _as_text(result.stderr))
    if check and status != 0:
        raise RemoteCommandFailed(node, argv, status, _tail(completed.stderr))
    return completed


# -- files -----------------------------------------------------------------------


def _sftp_error(node: str, what: str, exc: Exception) -> SshError:
    reason = exc.reason if isinstance(exc, asyncssh.Error) else str(exc)
    return RemoteFileError(node, f"{what}: {reason}", "")


async def put_file(
    conn: asyncssh.SSHClientConnection,
    local: str | os.PathLike[str],
    remote: str,
    mode: int | None = None,
) -> None:
    """Copy a local file to `remote` (relative paths are from the remote home).

    Missing parent directories are created.  The data goes to a temporary
    name that already has `mode` and is then renamed over `remote`, so a
    secret is never readable with looser permissions and a reader never sees
    half a file.
    """
    node = _node(conn)
    try:
        src = open(local, "rb")  # noqa: SIM115 - closed below, spans the SFTP session
    except OSError as exc:
        raise RemoteFileError(
            node, f"cannot read local file {local}: {exc.strerror or exc}", ""
        ) from None
    parent = posixpath.dirname(remote)

    async def copy(dst: asyncssh.SFTPClientFile) -> None:
        while chunk := src.read(_SFTP_CHUNK):
            await dst.write(chunk)

    try:
        async with conn.start_sftp_client() as sftp:
            if parent:
                await sftp.makedirs(parent, exist_ok=True)
            await _write_atomically(sftp, remote, mode, copy)
    except (asyncssh.Error, OSError) as exc:
        raise _sftp_error(node, f"cannot write {remote}", exc) from None
    finally:
        src.close()


async def put_files(
    conn: asyncssh.SSHClientConnection,
    files: Mapping[str, bytes],
    *,
    mode: int | None = None,
    dir_mode: int | None = None,
) -> None:
    """Write several small files (remote path -> content) over one SFTP session.

    Each file is written like `put_file` does (temporary name with `mode`
    already set, then renamed), so secrets are never readable with looser
    permissions. Parent directories are created, and set to `dir_mode` if given.
    """
    node = _node(conn)
    current = ""
    try:
        async with conn.start_sftp_client() as sftp:
            parents = sorted({posixpath.dirname(remote) for remote in files} - {""})
            for parent in parents:
                current = parent
                await sftp.makedirs(parent, exist_ok=True)
                if dir_mode is not None:
                    await sftp.chmod(parent, dir_mode)
            for remote, data in files.items():
                current = remote

                async def write(dst: asyncssh.SFTPClientFile, data: bytes = data) -> None:
                    await dst.write(data)

                await _write_atomically(sftp, remote, mode, write)
    except (asyncssh.Error, OSError) as exc:
        raise _sftp_error(node, f"cannot write {current or 'files'}", exc) from None


async def _write_atomically(
    sftp: asyncssh.SFTPClient,
    remote: str,
    mode: int | None,
    write: Callable[[asyncssh.SFTPClientFile], Awaitable[None]],
) -> None:
    """Write to a temporary name that already has `mode`, then rename it over
    `remote`: a secret is never readable with looser permissions and a reader never
    sees half a file."""
    parent = posixpath.dirname(remote)
    tmp = posixpath.join(parent, f".{posixpath.basename(remote)}.tmp-{secrets.token_hex(4)}")
    attrs = asyncssh.SFTPAttrs(permissions=mode) if mode is not None else asyncssh.SFTPAttrs()
    try:
        async with sftp.open(tmp, "wb", attrs) as dst:
            await write(dst)
        if mode is not None:
            # The creation mode was filtered through the server's umask; set it exactly.
            await sftp.chmod(tmp, mode)
        await sftp.posix_rename(tmp, remote)
    except BaseException:
        with contextlib.suppress(asyncssh.Error, OSError):
            await sftp.remove(tmp)
        raise


async def get_files(
    conn: asyncssh.SSHClientConnection,
    files: Mapping[str, Path],
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Copy remote files (remote path -> local path) here over one SFTP session, in
    bounded chunks; the bytes received. The caller verifies what landed (sizes and
    hashes it learned from the node's agent), so a half copy is never used."""
    node = _node(conn)
    current, received = "", 0
    try:
        async with conn.start_sftp_client() as sftp:
            for remote, local in files.items():
                current = remote
                local.parent.mkdir(parents=True, exist_ok=True)
                async with sftp.open(remote, "rb") as src:
                    with open(local, "wb") as dst:
                        while chunk := cast(bytes, await src.read(_SFTP_CHUNK)):
                            dst.write(chunk)
                            received += len(chunk)
                            if on_bytes:
                                on_bytes(received)
    except asyncssh.SFTPNoSuchFile:
        raise RemoteFileError(node, f"{current} does not exist", "") from None
    except (asyncssh.Error, OSError) as exc:
        raise _sftp_error(node, f"cannot read {current or 'files'}", exc) from None
    return received


async def read_file_since(
    conn: asyncssh.SSHClientConnection, path: str, offset: int, max_bytes: int = 1 << 20
) -> tuple[bytes, int]:
    """Bytes appended to a remote file since `offset`, and the offset to ask next.

    For following a log: a negative `offset` counts back from the current end
    (`-65536`: the last 64 KiB), and a file that shrank below `offset`
    (truncated or replaced) is read again from its start. At most `max_bytes`
    are returned per call; the rest comes with the next call.
    """
    node = _node(conn)
    try:
        async with conn.start_sftp_client() as sftp, sftp.open(path, "rb") as f:
            size = (await f.stat()).size or 0
            if offset < 0:
                offset = max(0, size + offset)
            elif size < offset:
                offset = 0
            if size == offset:
                return b"", offset
            await f.seek(offset)
            data = cast(bytes, await f.read(min(size - offset, max_bytes)))
    except asyncssh.SFTPNoSuchFile:
        raise RemoteFileError(node, f"{path} does not exist", "") from None
    except (asyncssh.Error, OSError) as exc:
        raise _sftp_error(node, f"cannot read {path}", exc) from None
    return data, offset + len(data)


async def read_file_tail(conn: asyncssh.SSHClientConnection, path: str, lines: int) -> str:
    """The last `lines` lines of a remote file (e.g. a worker's log).

    Reads backwards over SFTP so a multi-gigabyte log costs a few chunks,
    and needs no `tail` on the remote side.
    """
    if lines <= 0:
        return ""
    node = _node(conn)
    try:
        async with conn.start_sftp_client() as sftp, sftp.open(path, "rb") as f:
            size = (await f.stat()).size or 0
            data = b""
            pos = size
            # One more newline than lines asked for marks where the tail starts
            # (a trailing newline ends the last line, it does not start one).
            while pos > 0 and data.count(b"\n") <= lines:
                step = min(_SFTP_CHUNK, pos)
                pos -= step
                await f.seek(pos)
                data = cast(bytes, await f.read(step)) + data
    except asyncssh.SFTPNoSuchFile:
        raise RemoteFileError(node, f"{path} does not exist", "") from None
    except (asyncssh.Error, OSError) as exc:
        raise _sftp_error(node, f"cannot read {path}", exc) from None
    text = data.decode("utf-8", errors="replace")
    kept = text.splitlines(keepends=True)[-lines:]
    return "".join(kept)
