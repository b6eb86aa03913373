"""Which files of a model directory a shard needs, and copying them to a node.

A node that runs layers [start, end) needs the small files (config, tokenizer,
index) and only the safetensors files that hold its tensors, found through
`model.safetensors.index.json` the way mlx-lm's own sharded loading does. The
choice is pure. A file's identity is its content (size and SHA-256, see
`worker.shared.manifest`): a node's file with the right name but another hash is replaced.
The operator's copy is SFTP into a part file that resumes where it stopped; the
node's agent verifies each part before it takes the file's name.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from studiotui.core.model_facts import ModelDirError, outside_links
from studiotui.core.placement import format_bytes
from worker.shared.manifest import FileId, in_hub_cache, manifest, part_name, plain_name
from worker.shared.protocol.control import DirStatus

SMALL_SUFFIXES = {".json", ".txt", ".model", ".jinja", ".tiktoken", ".md"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class NeededFile:
    name: str
    size: int


class ModelFilesError(ModelDirError):
    """A model directory that cannot be used as it is; the message names the file."""


def escaping_names(names: Iterable[str]) -> list[str]:
    """The names (from an index's weight_map) that would leave the model directory."""
    return sorted({n for n in names if not plain_name(n)})


def check_model_dir(model_dir: Path) -> None:
    """Refuse, naming the file, an index entry or a file that leaves the directory.

    Run before anything reads the model (headers, copies): nothing outside the
    model directory is read or written on its behalf."""
    if not model_dir.is_dir():
        return  # read_model says so, with its own words
    index = model_dir / "model.safetensors.index.json"
    mapped: set[str] = set()
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            mapped = {str(v) for v in weight_map.values()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFilesError(f"{index} has no readable weight_map: {exc}") from None
    bad = escaping_names(mapped)
    if bad:
        raise ModelFilesError(
            f"{index} names {bad[0]!r}, which is outside the model directory; a model's "
            "files must sit in its own folder (fix the index or use another model)"
        )
    local = {
        p.name
        for p in model_dir.iterdir()
        if p.suffix in SMALL_SUFFIXES or p.suffix == ".safetensors"
    }
    outside = outside_links(model_dir, mapped | local)
    if outside:
        real = (model_dir / outside[0]).resolve()
        raise ModelFilesError(
            f"{model_dir / outside[0]} links to {real}, outside the model directory; "
            "copy the file into the model folder instead of linking it"
        )


def needed_names(
    model_dir: Path, start: int, end: int, n_layers: int, tied: bool = False
) -> set[str]:
    """The names of the files a shard of layers [start, end) must have: the small ones
    present in `model_dir`, and the weight files its tensors live in (by the index;
    the weights themselves need not be there)."""
    names = {
        p.name
        for p in model_dir.iterdir()
        if p.is_file() and p.suffix in SMALL_SUFFIXES and not p.name.startswith(".")
    }
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        bad = escaping_names(weight_map.values())
        if bad:
            raise ModelFilesError(f"{index} names {bad[0]!r}, outside the model directory")
        names |= {
            file for key, file in weight_map.items() if _wanted(key, start, end, n_layers, tied)
        }
    else:
        found = {p.name for p in model_dir.glob("*.safetensors")}
        names |= found or {"model.safetensors"}
    return names


def needed_files(
    model_dir: Path, start: int, end: int, n_layers: int, tied: bool = False
) -> list[NeededFile]:
    """The files a shard of layers [start, end) must have, smallest first."""
    names = needed_names(model_dir, start, end, n_layers, tied)
    files = [NeededFile(n, (model_dir / n).stat().st_size) for n in names]
    return sorted(files, key=lambda f: (f.size, f.name))


def even_shares(n_layers: int, nodes: list[str]) -> dict[str, tuple[int, int]]:
    """Layers split in order into equal runs (the first nodes take one more when it
    does not divide): what each node fetches before any plan says otherwise."""
    count = len(nodes)
    base, extra = divmod(n_layers, count)
    shares, start = {}, 0
    for i, node in enumerate(nodes):
        end = start + base + (1 if i < extra else 0)
        shares[node] = (start, end)
        start = end
    return shares


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
    if not in_hub_cache(model_dir):
        return None
    if model_dir.is_relative_to(home):
        return model_dir.relative_to(home).as_posix()
    return path


def copy_name(model_dir: Path) -> str:
    """The folder a copy of the model gets under the node's `models/`: a hub snapshot's
    own name is a bare commit hash, so it becomes `org--name@<commit[:12]>`."""
    if in_hub_cache(model_dir):
        repo = model_dir.parent.parent.name.removeprefix("models--")
        return f"{repo}@{model_dir.name[:12]}"
    return model_dir.name


def local_manifest(
    model_dir: Path, files: list[NeededFile], on_bytes: Callable[[int], None] | None = None
) -> list[FileId]:
    """The needed files by content. The hashes are cached next to the files (not in a
    hub snapshot, whose folder belongs to the hub's cache and whose weights state
    their hash in their link)."""
    ids = manifest(
        model_dir,
        [f.name for f in files],
        write_cache=not in_hub_cache(model_dir),
        on_bytes=on_bytes,
    )
    missing = [f.name for f in files if f.name not in ids]
    if missing:
        raise ModelFilesError(f"{model_dir / missing[0]} is missing")
    return [ids[f.name] for f in files]


@dataclass(frozen=True)
class CopyPlan:
    """What a node needs done to hold `wanted` in one directory (pure: from its status)."""

    keep: tuple[str, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()  # (file, why its copy is not the model's)
    send: tuple[tuple[FileId, int], ...] = ()  # (file, offset its part resumes from)
    resumed: int = 0
    notes: list[str] = field(default_factory=list, compare=False)

    @property
    def bytes_to_send(self) -> int:
        return sum(f.size - offset for f, offset in self.send)

    @property
    def complete(self) -> bool:
        return not self.send


def plan_copy(wanted: list[FileId], found: DirStatus) -> CopyPlan:
    """Compare the model's files with what one directory of a node holds (the agent's
    `files_status` answer for it): keep the same, replace what differs (saying why),
    resume parts of the same content."""
    by_name = {f.name: f for f in found.files}
    keep: list[str] = []
    replace: list[tuple[str, str]] = []
    send: list[tuple[FileId, int]] = []
    for f in wanted:
        have = by_name.get(f.name)
        if have is not None and have.state == "same":
            keep.append(f.name)
            continue
        if have is not None and have.state == "differs":
            if have.size != f.size:
                why = f"it has {have.size} bytes, the model's file {f.size}"
            else:
                why = (
                    f"same size but sha256 {str(have.sha256)[:12]} is not the model's "
                    f"{f.sha256[:12]}"
                )
            replace.append((f.name, why))
        partial = have.partial if have is not None else 0
        send.append((f, partial if 0 < partial <= f.size else 0))
    resumed = sum(offset for _, offset in send)
    return CopyPlan(tuple(keep), tuple(replace), tuple(send), resumed)


def disk_refusal(node: str, path: str, needed: int, free: int) -> str | None:
    """A sentence with the numbers when `node` lacks the room for a copy, else None."""
    if needed <= free:
        return None
    return (
        f"{node} has {format_bytes(free)} free at {path} but the model's files need "
        f"{format_bytes(needed)} more there: free disk space on {node} or place on other nodes"
    )


SFTP_CHUNK = 8 * 1024 * 1024


async def send_files(
    conn: object,
    local_dir: Path,
    remote_dir: str,
    send: Iterable[tuple[FileId, int]],
    progress: Progress | None = None,
) -> int:
    """Copy each file into its part on the node over SFTP, from the offset its part
    already holds; bytes sent. The agent verifies and renames the parts afterwards."""
    import asyncssh

    assert isinstance(conn, asyncssh.SSHClientConnection)
    todo = list(send)
    total = sum(f.size for f, _ in todo)
    done = sum(offset for _, offset in todo)
    sent = 0
    async with conn.start_sftp_client() as sftp:
        await sftp.makedirs(remote_dir, exist_ok=True)
        for f, offset in todo:
            target = f"{remote_dir}/{part_name(f)}"
            async with sftp.open(target, "r+b" if offset else "wb") as dst:
                with open(local_dir / f.name, "rb") as src:
                    src.seek(offset)
                    position = offset
                    while chunk := src.read(SFTP_CHUNK):
                        await dst.write(chunk, position)
                        position += len(chunk)
                        sent += len(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total)
    return sent
