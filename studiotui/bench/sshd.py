"""A real OpenSSH sshd on loopback addresses, for the benchmark and the tests.

The cluster manager's whole job is talking to real sshd's, so the provisioning
benchmark and the tests run one instead of a fake: quoting, SFTP, host key and auth
failures then behave exactly as they will against the Macs. Install it with
`.ci/install-sshd.sh`. The pytest fixtures are in `tests/support/sshd.py`.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "ssh-keygen"

# Linux routes all of 127.0.0.0/8 to lo, so these need no setup; each stands
# for one Mac of the desk cluster.
DEFAULT_ADDRESSES: tuple[str, ...] = ("127.0.0.21", "127.0.0.22", "127.0.0.23", "127.0.0.24")

START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0


class SshdError(RuntimeError):
    """sshd could not be prepared or started; carries its log for diagnosis."""


def _keygen(path: Path, comment: str) -> None:
    for stale in (path, path.with_name(path.name + ".pub")):
        stale.unlink(missing_ok=True)
    # ssh-keygen prompts before overwriting and needs -N "" to skip the
    # passphrase prompt; both would hang a test run.
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )


def _fingerprint(pub_path: Path) -> str:
    out = subprocess.run(
        [SSH_KEYGEN, "-l", "-E", "sha256", "-f", str(pub_path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # "256 SHA256:xxxx comment (ED25519)"
    return out.split()[1]


def _free_port(addresses: Sequence[str]) -> int:
    """A port that is free on every address right now.

    There is a window between closing these probe sockets and sshd binding,
    so `start` retries on "Address already in use".
    """
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((addresses[0], 0))
            port = probe.getsockname()[1]
        try:
            for addr in addresses:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((addr, port))
        except OSError:
            continue
        return port
    raise SshdError(f"no port free on all of {', '.join(addresses)}")


class SshdServer:
    """One sshd process listening on several loopback addresses, one port."""

    def __init__(self, workdir: Path, addresses: Sequence[str] = DEFAULT_ADDRESSES) -> None:
        if not addresses:
            raise ValueError("need at least one listen address")
        self.workdir = workdir
        self.addresses: tuple[str, ...] = tuple(addresses)
        self.user = getpass.getuser()
        self.port = 0
        self.host_key = workdir / "ssh_host_ed25519_key"
        self.client_key = workdir / "id_ed25519"
        self.authorized_keys = workdir / "authorized_keys"
        self.known_hosts = workdir / "known_hosts"
        self.config = workdir / "sshd_config"
        self.pid_file = workdir / "sshd.pid"
        self.log_file = workdir / "sshd.log"
        self.host_key_fingerprint = ""
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        if not os.access(SSHD, os.X_OK):
            raise SshdError(f"{SSHD} not found; run .ci/install-sshd.sh")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.host_key.exists():
            _keygen(self.host_key, "studiotui-test-host")
        if not self.client_key.exists():
            _keygen(self.client_key, "studiotui-test-client")
            pub = self.client_key.with_name(self.client_key.name + ".pub")
            shutil.copyfile(pub, self.authorized_keys)
        self.host_key_fingerprint = _fingerprint(
            self.host_key.with_name(self.host_key.name + ".pub")
        )

        # A fixed port survives restarts so known_hosts entries stay keyed the
        # same; only the first start (or a lost bind race) picks a new one.
        keep_port = self.port != 0
        last_error: SshdError | None = None
        for _ in range(1 if keep_port else 5):
            if not keep_port:
                self.port = _free_port(self.addresses)
            try:
                self._spawn()
                break
            except SshdError as exc:
                last_error = exc
                if "Address already in use" not in str(exc):
                    raise
        else:
            assert last_error is not None
            raise last_error
        if not self.known_hosts.exists():
            self.write_known_hosts()

    def _write_config(self) -> None:
        listen = "\n".join(f"ListenAddress {addr}:{self.port}" for addr in self.addresses)
        self.config.write_text(
            f"""\
Port {self.port}
{listen}
HostKey {self.host_key}
PidFile {self.pid_file}
AuthorizedKeysFile {self.authorized_keys}
# The tmp dir is world-traversable and owned by whoever runs the tests.
StrictModes no
# Tests run as root in CI containers.
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
Subsystem sftp internal-sftp
LogLevel VERBOSE
# Parallel-connection tests open many sessions at once.
MaxStartups 100
MaxSessions 100
"""
        )

    def _spawn(self) -> None:
        self._write_config()
        self.pid_file.unlink(missing_ok=True)
        log = self.log_file.open("ab")
        try:
            self._proc = subprocess.Popen(
                # sshd insists on an absolute path because it re-execs itself.
                [SSHD, "-D", "-e", "-f", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        pending = list(self.addresses)
        while pending:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise SshdError(
                    f"sshd exited with status {self._proc.returncode} before listening "
                    f"on port {self.port}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise SshdError(
                    f"sshd not accepting on {', '.join(pending)} port {self.port} "
                    f"after {START_TIMEOUT:.0f}s:\n{self.log()}"
                )
            addr = pending[0]
            try:
                with socket.create_connection((addr, self.port), timeout=0.5):
                    pending.pop(0)
            except OSError:
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop our sshd (by its pid only), escalating to SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SshdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- keys ----------------------------------------------------------------

    def known_hosts_lines(self) -> list[str]:
        pub = self.host_key.with_name(self.host_key.name + ".pub").read_text().split()
        key = f"{pub[0]} {pub[1]}"
        return [f"[{addr}]:{self.port} {key}" for addr in self.addresses]

    def write_known_hosts(self, path: Path | None = None) -> Path:
        """Write a known_hosts trusting the current host key on every address."""
        path = path or self.known_hosts
        path.write_text("\n".join(self.known_hosts_lines()) + "\n")
        return path

    def regenerate_host_key(self) -> str:
        """Give the server a new host key and restart it; returns the new fingerprint.

        `known_hosts` is deliberately left with the old key so a client sees
        a changed host key; call `write_known_hosts()` to trust the new one.
        """
        self.stop()
        _keygen(self.host_key, "studiotui-test-host")
        self.start()
        return self.host_key_fingerprint

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return "(no sshd log)"


def start_sshd(
    addresses: Sequence[str] = DEFAULT_ADDRESSES, workdir: Path | None = None
) -> SshdServer:
    """Start a server in its own temp dir; the caller must `cleanup()` it."""
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="studiotui-sshd-"))
    server = SshdServer(workdir, addresses)
    try:
        server.start()
    except BaseException:
        server.cleanup()
        raise
    return server
