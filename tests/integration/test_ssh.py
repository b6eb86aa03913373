"""studiotui.ssh.client against a real OpenSSH sshd on loopback (see tests/support/sshd.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from studiotui.ssh.client import (
    AuthFailed,
    ChangedHostKey,
    HostUnreachable,
    RemoteCommandFailed,
    SshError,
    SshTarget,
    UnknownHostKey,
    connect,
    put_file,
    read_file_tail,
    run,
)
from tests.support.sshd import SshdServer, sshd_factory, sshd_server  # noqa: F401

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),
    # In CI the SSH tests must run: there a missing sshd is a failure, not a skip.
    pytest.mark.skipif(
        shutil.which("ssh-keygen") is None and not os.environ.get("CI"),
        reason="run .ci/install-sshd.sh",
    ),
]

# Generous against CI jitter, yet far below anything that would look like a hang.
SHORT_TIMEOUT = 1.5


def target(server: SshdServer, addr: str = "127.0.0.21", **changes: Any) -> SshTarget:
    base = SshTarget(
        host=addr,
        port=server.port,
        user=server.user,
        identity=str(server.client_key),
        known_hosts=server.known_hosts,
        node=f"mac-{addr.rsplit('.', 1)[1]}",
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def silent_listener() -> Iterator[tuple[str, int]]:
    """Accepts TCP connections and never says a word, like a wedged sshd."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.98", 0))
    sock.listen(8)
    try:
        # The kernel completes the handshake from the backlog; never calling
        # accept() keeps the peer waiting for a banner forever.
        yield "127.0.0.98", sock.getsockname()[1]
    finally:
        sock.close()


def _unused_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@pytest.fixture
async def conn(sshd_server: SshdServer) -> AsyncIterator[object]:  # noqa: F811
    c = await connect(target(sshd_server))
    try:
        yield c
    finally:
        c.close()
        await c.wait_closed()


async def test_run_passes_arguments_literally(conn) -> None:
    tricky = """it's a "quoted" $HOME with spaces; `touch /tmp/pwned` \\ end"""
    out = await run(conn, ["echo", tricky, "", "two"])
    assert out.exit_status == 0
    assert out.stdout == tricky + "  two\n"


async def test_run_feeds_input_and_reports_failure(conn) -> None:
    out = await run(conn, ["cat"], input="via stdin\n")
    assert out.stdout == "via stdin\n"

    with pytest.raises(RemoteCommandFailed) as info:
        await run(conn, ["sh", "-c", "echo first >&2; echo boom >&2; exit 3"])
    err = info.value
    assert err.exit_status == 3
    assert err.node == "mac-21"
    assert err.stderr_tail.endswith("boom")
    assert "mac-21" in str(err) and "status 3" in str(err)

    out = await run(conn, ["sh", "-c", "exit 4"], check=False)
    assert out.exit_status == 4


async def test_put_file_creates_parent_with_spaces_and_mode(conn, tmp_path: Path) -> None:
    local = tmp_path / "secret.env"
    local.write_text("TOKEN=abc\n")
    remote_dir = tmp_path / "remote dir 'with' quotes" / "nested"
    remote = remote_dir / "worker token.env"

    await put_file(conn, local, str(remote), mode=0o600)
    assert remote.read_text() == "TOKEN=abc\n"
    assert stat.S_IMODE(remote.stat().st_mode) == 0o600

    # Overwrite in place, and no temp files are left next to it.
    local.write_text("TOKEN=new\n")
    await put_file(conn, local, str(remote), mode=0o640)
    assert remote.read_text() == "TOKEN=new\n"
    assert stat.S_IMODE(remote.stat().st_mode) == 0o640
    assert sorted(p.name for p in remote_dir.iterdir()) == ["worker token.env"]

    # The remote shell sees the same path: quoting and SFTP agree.
    out = await run(conn, ["cat", str(remote)])
    assert out.stdout == "TOKEN=new\n"


async def test_read_file_tail(conn, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    # Longer than one SFTP chunk so the backwards read has to step.
    log.write_text("".join(f"line {i} {'x' * 100}\n" for i in range(5000)))
    tail = await read_file_tail(conn, str(log), 3)
    assert tail.splitlines() == [f"line {i} {'x' * 100}" for i in (4997, 4998, 4999)]

    short = tmp_path / "short.log"
    short.write_text("a\nb")
    assert await read_file_tail(conn, str(short), 10) == "a\nb"

    with pytest.raises(SshError, match=r"mac-21.*does not exist"):
        await read_file_tail(conn, str(tmp_path / "missing.log"), 5)


async def test_unknown_host_key_refused_then_accepted(
    sshd_server: SshdServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    known_hosts = tmp_path / "known_hosts"  # does not exist yet
    t = target(sshd_server, "127.0.0.22", known_hosts=known_hosts)

    with pytest.raises(UnknownHostKey) as info:
        await connect(t)
    err = info.value
    assert err.fingerprint == sshd_server.host_key_fingerprint
    assert sshd_server.host_key_fingerprint in str(err)
    assert "--accept-new-host-keys" in str(err)
    assert "mac-22" in str(err)
    assert not known_hosts.exists()

    c = await connect(t, accept_new_host_keys=True)
    try:
        assert (await run(c, ["true"])).exit_status == 0
    finally:
        c.close()
        await c.wait_closed()
    lines = known_hosts.read_text().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"[127.0.0.22]:{sshd_server.port} ssh-ed25519 ")

    # Now it is known: no flag needed, and nothing appended twice.
    c = await connect(t)
    c.close()
    await c.wait_closed()
    assert known_hosts.read_text().splitlines() == lines


async def test_changed_host_key_refused_even_with_flag(
    sshd_factory: Callable[..., SshdServer],  # noqa: F811
) -> None:
    # A private server: changing the shared one's key would break other tests.
    server = sshd_factory(["127.0.0.24"])
    old_fp = server.host_key_fingerprint
    t = target(server, "127.0.0.24")
    c = await connect(t)
    c.close()
    await c.wait_closed()

    new_fp = server.regenerate_host_key()
    assert new_fp != old_fp
    before = server.known_hosts.read_text()
    for accept in (False, True):
        with pytest.raises(ChangedHostKey) as info:
            await connect(t, accept_new_host_keys=accept)
        err = info.value
        text = str(err)
        assert err.expected == [old_fp] and err.offered == new_fp
        assert old_fp in text and new_fp in text
        assert "mac-24" in text
        assert f"line 1: [127.0.0.24]:{server.port} ssh-ed25519" in text
        assert err.known_hosts_lines[0][0] == 1
    assert server.known_hosts.read_text() == before


async def test_wrong_key_is_auth_failed(sshd_server: SshdServer, tmp_path: Path) -> None:  # noqa: F811
    wrong = tmp_path / "id_wrong"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)]
    proc = await asyncio.create_subprocess_exec(*keygen, stdin=asyncio.subprocess.DEVNULL)
    assert await proc.wait() == 0
    t = target(sshd_server, "127.0.0.23", identity=str(wrong))
    with pytest.raises(AuthFailed) as info:
        await connect(t)
    text = str(info.value)
    assert "mac-23" in text
    assert str(wrong) in text
    assert repr(sshd_server.user) in text

    with pytest.raises(AuthFailed, match="does not exist"):
        await connect(target(sshd_server, identity=str(tmp_path / "nope")))


async def test_unreachable_address(sshd_server: SshdServer) -> None:  # noqa: F811
    t = target(sshd_server, "127.0.0.99", port=_unused_port("127.0.0.99"))
    start = time.monotonic()
    with pytest.raises(HostUnreachable) as info:
        await connect(t, timeout=SHORT_TIMEOUT)
    assert time.monotonic() - start < SHORT_TIMEOUT + 1
    assert "mac-99" in str(info.value) and "refused" in str(info.value)


async def test_unresolvable_name(sshd_server: SshdServer) -> None:  # noqa: F811
    t = target(sshd_server, "no-such-mac.invalid", node="mac-ghost")
    with pytest.raises(HostUnreachable, match="mac-ghost"):
        await connect(t, timeout=SHORT_TIMEOUT)


async def test_silent_listener_times_out(
    sshd_server: SshdServer,  # noqa: F811
    silent_listener: tuple[str, int],
) -> None:
    addr, port = silent_listener
    t = target(sshd_server, addr, port=port, node="mac-silent")
    start = time.monotonic()
    with pytest.raises(HostUnreachable) as info:
        await connect(t, timeout=SHORT_TIMEOUT)
    elapsed = time.monotonic() - start
    assert SHORT_TIMEOUT - 0.2 < elapsed < SHORT_TIMEOUT + 1
    assert "mac-silent" in str(info.value)


async def test_parallel_connections(sshd_server: SshdServer) -> None:  # noqa: F811
    addrs = ["127.0.0.21", "127.0.0.22", "127.0.0.23"]
    conns = await asyncio.gather(*(connect(target(sshd_server, a)) for a in addrs))
    try:
        results = await asyncio.gather(
            *(
                run(c, ["sh", "-c", 'sleep 0.3; echo "$1"', "sh", a])
                for c, a in zip(conns, addrs, strict=True)
            )
        )
        assert [r.stdout.strip() for r in results] == addrs
    finally:
        for c in conns:
            c.close()
        await asyncio.gather(*(c.wait_closed() for c in conns))
