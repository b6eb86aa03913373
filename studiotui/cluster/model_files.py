"""Which files of a model directory a shard needs, and copying them to a node.

A node that runs layers [start, end) needs the small files (config, tokenizer,
index) and only the safetensors files that hold its tensors, found through
`model.safetensors.index.json` the way mlx-lm's own sharded loading does. The
choice is pure; the copy is SFTP from the operator, skipping files already there
with the same size.

A Hugging Face snapshot is not copied when the node already holds it: its path
names the repository and the commit (`models--org--name/snapshots/<commit>`), so a
node whose cache has that path, with every needed file at the same size, has the
same model, typically downloaded there beforehand. The path is looked for relative
to the node's home when the model is under the operator's home (same cache layout,
another user name), else as the same absolute path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SMALL_SUFFIXES = {".json", ".txt", ".model", ".jinja", ".tiktoken", ".md"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SNAPSHOT = re.compile(r"(?:^|/)models--[^/]+/snapshots/[^/]+$")

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class NeededFile:
    name: str
    size: int


def needed_files(
    model_dir: Path, start: int, end: int, n_layers: int, tied: bool = False
) -> list[NeededFile]:
    """The files a shard of layers [start, end) must have, smallest first."""
    names = {p.name for p in model_dir.iterdir() if p.is_file() and p.suffix in SMALL_SUFFIXES}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names |= {
            file for key, file in weight_map.items() if _wanted(key, start, end, n_layers, tied)
        }
    else:
        names |= {p.name for p in model_dir.glob("*.safetensors")}
    files = [NeededFile(n, (model_dir / n).stat().st_size) for n in names]
    return sorted(files, key=lambda f: (f.size, f.name))


def _wanted(key: str, start: int, end: int, n_layers: int, tied: bool) -> bool:
    if m := _LAYER.search(key):
        return start <= int(m.group(1)) < end
    first, last = start == 0, end == n_layers
    if "embed_tokens" in key:
        return first or (last and tied)
    return last  # final norm, lm_head


def hub_snapshot_path(model_dir: Path, home: Path) -> str | None:
    """Where a node would hold the same Hugging Face snapshot: relative to its home
    (SFTP resolves it there) when `model_dir` is under the operator's `home`, else the
    same absolute path. None when `model_dir` is not a hub snapshot."""
    path = model_dir.as_posix().rstrip("/")
    if not _SNAPSHOT.search(path):
        return None
    if model_dir.is_relative_to(home):
        return model_dir.relative_to(home).as_posix()
    return path


def copy_name(model_dir: Path) -> str:
    """The folder a copy of the model gets under the node's `models/`: a hub snapshot's
    own name is a bare commit hash, so it becomes `org--name@<commit[:12]>`."""
    if _SNAPSHOT.search(model_dir.as_posix().rstrip("/")):
        repo = model_dir.parent.parent.name.removeprefix("models--")
        return f"{repo}@{model_dir.name[:12]}"
    return model_dir.name


async def find_on_node(conn: object, candidate: str, files: list[NeededFile]) -> str | None:
    """The node's absolute path of `candidate` when it holds every file in `files`
    with the same size (symlinks followed, as the hub cache links to blobs)."""
    import asyncssh

    assert isinstance(conn, asyncssh.SSHClientConnection)
    async with conn.start_sftp_client() as sftp:
        try:
            absolute = await sftp.realpath(candidate)
            for f in files:
                if (await sftp.stat(f"{absolute}/{f.name}")).size != f.size:
                    return None
        except asyncssh.SFTPError:
            return None
    return absolute


async def sync_files(
    conn: object,
    local_dir: Path,
    remote_dir: str,
    files: list[NeededFile],
    progress: Progress | None = None,
) -> int:
    """Copy the files the node lacks (or has with another size); bytes copied."""
    import asyncssh

    assert isinstance(conn, asyncssh.SSHClientConnection)
    total = sum(f.size for f in files)
    done = 0
    copied = 0
    async with conn.start_sftp_client() as sftp:
        await sftp.makedirs(remote_dir, exist_ok=True)
        for f in files:
            target = f"{remote_dir}/{f.name}"
            try:
                same = (await sftp.stat(target)).size == f.size
            except asyncssh.SFTPError:
                same = False
            if not same:
                base = done

                def step(
                    _src: bytes, _dst: bytes, sent: int, _total: int, base: int = base
                ) -> None:
                    if progress:
                        progress(base + sent, total)

                await sftp.put(str(local_dir / f.name), target + ".part", progress_handler=step)
                await sftp.posix_rename(target + ".part", target)
                copied += f.size
            done += f.size
            if progress:
                progress(done, total)
    return copied
