"""Model files on a node: what it holds, landing copies safely, and node-to-node copies.

Every copy, whoever sends it, lands in `<name>.studiotui-part` next to its final
name; an interrupted copy resumes from the part's length. A part becomes the file
only after its size and SHA-256 equal what the model's manifest says, so a shard
never loads a file that was not verified.

Node to node: the agent that holds the files serves them on a ROUTER of its own
(CURVE, the same authorized keys as every cluster socket, bound to the node's
cluster address), but only the files the controller granted under a random token.
The agent that needs them connects a DEALER and asks for chunks, keeping a few in
flight: memory stays bounded (WINDOW x CHUNK) whatever the file size, and the
operator's machine carries no model bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from worker.shared.manifest import (
    FileId,
    free_bytes,
    manifest,
    part_name,
    plain_name,
    remember,
    sha256_file,
    sha256_state,
)
from worker.shared.protocol import control, curve
from worker.shared.protocol.control import Error, Message, encode
from worker.shared.protocol.messages import MessageError

log = logging.getLogger("studiotui.files")
CHUNK = 4 * 1024 * 1024
WINDOW = 4
FETCH_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 0.5

Progress = Callable[[int, int], None]


class FileError(RuntimeError):
    pass


def human_bytes(n: float) -> str:
    """1.5 GB, 320 MB, 64 KB: for messages a person reads."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def resolve_dir(home: Path, directory: str) -> Path:
    """A directory the controller names: absolute, `~/...` (the node user's home) or
    relative to the agent's work dir (where copies go)."""
    path = Path(os.path.expanduser(directory))
    return path if path.is_absolute() else home / path


def part_path(directory: Path, f: FileId) -> Path:
    return directory / part_name(f)


def status(
    directory: Path, wanted: list[FileId], on_bytes: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """For each wanted file: same / differs / missing, the bytes of a part already
    there (to resume from) and the free disk where the files would go."""
    present = (
        # A hub snapshot's folder belongs to the hub's cache: hashed, never written to.
        manifest(
            directory,
            [f.name for f in wanted],
            write_cache=directory.parent.name != "snapshots",
            on_bytes=on_bytes,
        )
        if directory.is_dir()
        else {}
    )
    files = []
    for f in wanted:
        if not plain_name(f.name):
            raise FileError(f"{f.name!r} is not a plain file name inside the model directory")
        have = present.get(f.name)
        if have is None:
            state = "missing"
        elif have.size == f.size and have.sha256 == f.sha256:
            state = "same"
        else:
            state = "differs"
        part = part_path(directory, f)
        files.append(
            {
                "name": f.name,
                "state": state,
                "size": have.size if have else None,
                "sha256": have.sha256 if have else None,
                "partial": part.stat().st_size if part.is_file() else 0,
            }
        )
    return {"path": str(directory.resolve()), "free": free_bytes(directory), "files": files}


def commit(directory: Path, file: FileId, on_bytes: Callable[[int], None] | None = None) -> None:
    """Verify a landed part (size, then hash) and only then give it the file's name."""
    if not plain_name(file.name):
        raise FileError(f"{file.name!r} is not a plain file name inside the model directory")
    part = part_path(directory, file)
    size = part.stat().st_size if part.is_file() else -1
    if size != file.size:
        raise FileError(f"{file.name}: {size} bytes landed, the model's file has {file.size}")
    digest = sha256_file(part, on_bytes)
    if digest != file.sha256:
        part.unlink()
        raise FileError(
            f"{file.name}: the copy's sha256 {digest[:12]} is not the model's "
            f"{file.sha256[:12]}; the part was removed, copy it again"
        )
    os.replace(part, directory / file.name)
    remember(directory, file)


# ---- serving ---------------------------------------------------------------------------


@dataclass
class Grant:
    directory: Path
    files: dict[str, int]  # name -> size
    sent: int = 0


@dataclass
class FileServer:
    """Serves granted files to authorized peers; one per agent, started when needed."""

    ctx: zmq.asyncio.Context
    keys: curve.CurveKeys
    address: str
    port: int
    grants: dict[str, Grant] = field(default_factory=dict)
    sock: zmq.asyncio.Socket | None = None
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.make_server(self.sock, self.keys)
        self.sock.bind(f"tcp://{self.address}:{self.port}")
        self.task = asyncio.create_task(self._serve())

    def grant(self, directory: Path, files: dict[str, int]) -> str:
        token = secrets.token_hex(16)
        self.grants[token] = Grant(directory, files)
        return token

    def revoke(self, token: str) -> int:
        grant = self.grants.pop(token, None)
        return grant.sent if grant else 0

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.sock is not None:
            self.sock.close(linger=0)

    async def _serve(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                continue
            ident, data = frames
            header: Message
            try:
                msg = control.decode(data)
                if not isinstance(msg, control.ReadChunk):
                    raise FileError(f"a file server answers read, not {msg.kind}")
                header, chunk = await self._read(msg)
            except MessageError as exc:
                header = Error(code="bad_request", message=f"bad message: {exc}")
                chunk = b""
            except FileError as exc:
                header, chunk = Error(code="not_found", message=str(exc)), b""
            except OSError as exc:
                header, chunk = Error(code="failed", message=str(exc)), b""
            await self.sock.send_multipart([ident, encode(header), chunk], copy=False)

    async def _read(self, msg: control.ReadChunk) -> tuple[control.Chunk, bytes]:
        grant = self.grants.get(msg.token)
        if grant is None or msg.name not in grant.files:
            raise FileError(f"{msg.name} is not being served under this token")
        offset, length = msg.offset, min(msg.length, CHUNK)
        if offset < 0 or length < 0:
            raise FileError("negative offset or length")
        chunk = await asyncio.to_thread(_read_at, grant.directory / msg.name, offset, length)
        grant.sent += len(chunk)
        return control.Chunk(seq=msg.seq, offset=offset), chunk


def _read_at(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


# ---- fetching --------------------------------------------------------------------------


async def fetch(
    ctx: zmq.asyncio.Context,
    keys: curve.CurveKeys,
    endpoint: str,
    server_key: bytes,
    token: str,
    directory: Path,
    files: list[FileId],
    progress: Progress | None = None,
) -> dict[str, int]:
    """Copy `files` from a peer's FileServer into `directory`, each resumed from its
    part and verified before it is renamed. Returns bytes received and resumed."""
    bad = [f.name for f in files if not plain_name(f.name)]
    if bad:
        raise FileError(f"{bad[0]!r} is not a plain file name inside the model directory")
    directory.mkdir(parents=True, exist_ok=True)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    curve.make_client(sock, keys, server_key)
    sock.connect(endpoint)
    total = sum(f.size for f in files)
    done = received = resumed = 0
    last = 0.0

    def report(force: bool = False) -> None:
        nonlocal last
        now = time.monotonic()
        if progress and (force or now - last >= PROGRESS_EVERY_S):
            last = now
            progress(done, total)

    def landed(n: int) -> None:
        nonlocal done
        done += n
        report()

    try:
        for f in files:
            part = part_path(directory, f)
            if (await asyncio.to_thread(manifest, directory, [f.name])).get(f.name) == f:
                landed(f.size)
                continue
            start = part.stat().st_size if part.is_file() else 0
            if start > f.size:
                part.unlink()
                start = 0
            # The bytes that already landed count towards the hash: read them once.
            digest = (
                await asyncio.to_thread(sha256_state, part, start) if start else hashlib.sha256()
            )
            resumed += start
            landed(start)
            received += await _pull(sock, token, f, start, part, digest, landed)
            if digest.hexdigest() != f.sha256:
                part.unlink()
                raise FileError(
                    f"{f.name}: the bytes received hash to {digest.hexdigest()[:12]}, the "
                    f"model's file is {f.sha256[:12]}; the part was removed"
                )
            os.replace(part, directory / f.name)
            remember(directory, f)
            report(force=True)
    finally:
        sock.close(linger=0)
    return {"received": received, "resumed": resumed}


async def _pull(
    sock: zmq.asyncio.Socket,
    token: str,
    f: FileId,
    start: int,
    part: Path,
    digest: Any,
    on_bytes: Callable[[int], None],
) -> int:
    """Ask for chunks from `start`, WINDOW in flight, appending them in order."""
    offsets = list(range(start, f.size, CHUNK))
    asked = 0
    got = 0
    with open(part, "ab") as out:
        while asked < min(WINDOW, len(offsets)):
            await _ask(sock, token, f.name, offsets[asked], asked)
            asked += 1
        for i, offset in enumerate(offsets):
            try:
                async with asyncio.timeout(FETCH_TIMEOUT_S):
                    header_raw, chunk = await sock.recv_multipart()
            except TimeoutError:
                raise FileError(f"the source sent nothing for {FETCH_TIMEOUT_S:g} s") from None
            try:
                header = control.decode(header_raw)
            except MessageError as exc:
                raise FileError(f"the source sent a bad message: {exc}") from None
            if isinstance(header, control.Error):
                raise FileError(f"the source refused: {header.message}")
            if not isinstance(header, control.Chunk):
                raise FileError(f"the source answered {header.kind}, not a chunk")
            if header.seq != i or header.offset != offset:
                raise FileError(f"{f.name}: chunk {header.seq} arrived for {i}")
            expected = min(CHUNK, f.size - offset)
            if len(chunk) != expected:
                raise FileError(
                    f"{f.name}: the source sent {len(chunk)} bytes at {offset}, expected "
                    f"{expected} (its file changed?)"
                )
            if asked < len(offsets):
                await _ask(sock, token, f.name, offsets[asked], asked)
                asked += 1
            await asyncio.to_thread(_write, out, digest, chunk)
            got += len(chunk)
            on_bytes(len(chunk))
    return got


def _write(out: Any, digest: Any, chunk: bytes) -> None:
    out.write(chunk)
    digest.update(chunk)


async def _ask(sock: zmq.asyncio.Socket, token: str, name: str, offset: int, seq: int) -> None:
    ask = control.ReadChunk(token=token, name=name, offset=offset, length=CHUNK, seq=seq)
    await sock.send(encode(ask))
