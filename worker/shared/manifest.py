"""What a model directory holds, by content: file sizes and SHA-256 hashes.

A model is known by its bytes, not by its folder's or its files' names: a fine-tune
has the same file names and sizes as its base. Hashing hundreds of GB takes
minutes, so each directory keeps a cache (`.studiotui-manifest.json`, next to the
files) keyed by (size, mtime_ns): a second look hashes nothing. A file in a
Hugging Face snapshot links to `blobs/<sha256>` for weights (Git LFS objects), so
its hash is read from the link, not computed.

Stdlib only: the operator side imports this module too (its own model directory
gets the same manifest the nodes compute).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_NAME = ".studiotui-manifest.json"
PART_SUFFIX = ".studiotui-part"
CHUNK = 4 * 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--[^/]+/snapshots/[^/]+$")

Hashed = Callable[[int], None]
# (bytes hashed so far, bytes to hash): what a caller shows while a folder is hashed.
Hashing = Callable[[int, int], None]


@dataclass(frozen=True)
class FileId:
    name: str
    size: int
    sha256: str

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> FileId:
        return cls(str(raw["name"]), int(str(raw["size"])), str(raw["sha256"]))


def sha256_state(path: Path, upto: int | None = None, on_bytes: Hashed | None = None) -> Any:
    """A SHA-256 fed with the file (`upto`: only its first bytes), read in bounded chunks."""
    digest = hashlib.sha256()
    left = upto
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return digest


def sha256_file(path: Path, on_bytes: Hashed | None = None) -> str:
    return str(sha256_state(path, None, on_bytes).hexdigest())


def part_name(f: FileId) -> str:
    """Where a copy of `f` lands first. Named after its content too, so a part left
    by an interrupted copy only ever resumes the same bytes."""
    return f"{f.name}.{f.sha256[:16]}{PART_SUFFIX}"


def plain_name(name: str) -> bool:
    """A file name that stays inside the directory it is joined to: relative, no `..`,
    no empty or `.` parts, no backslash or NUL (never a path on any OS we serve)."""
    if not name or name.startswith(("/", "~")) or "\\" in name or "\0" in name:
        return False
    parts = name.split("/")
    return all(p not in ("", ".", "..") for p in parts) and ":" not in parts[0][1:2]


def in_hub_cache(directory: Path) -> bool:
    """A Hugging Face snapshot folder (`models--org--name/snapshots/<rev>`): it belongs
    to the hub's cache, so no manifest cache is written into it. The one test of it
    for both sides (the operator's model checks, copy names and hashing use it too)."""
    return bool(_HUB_SNAPSHOT.search(directory.as_posix().rstrip("/")))


def hub_blob_hash(path: Path) -> str | None:
    """The hash a hub cache link already states: weights link to `blobs/<sha256>`."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path)).name
    return target if _SHA256.match(target) and path.resolve().parent.name == "blobs" else None


def _load_cache(directory: Path) -> dict[str, dict[str, object]]:
    try:
        raw = json.loads((directory / CACHE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _save_cache(directory: Path, cache: dict[str, dict[str, object]]) -> None:
    """Written atomically; a directory we may not write to just stays uncached."""
    tmp = directory / f"{CACHE_NAME}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(cache, sort_keys=True))
        os.replace(tmp, directory / CACHE_NAME)
    with contextlib.suppress(OSError):
        tmp.unlink()


def manifest(
    directory: Path,
    names: Iterable[str],
    *,
    write_cache: bool = True,
    on_bytes: Hashed | None = None,
) -> dict[str, FileId]:
    """Size and hash of each named file that exists (missing ones are left out).

    A cached hash is used while the file's size and mtime_ns are unchanged."""
    cache = _load_cache(directory)
    changed = False
    out: dict[str, FileId] = {}
    for name in names:
        path = directory / name
        try:
            st = path.stat()
        except OSError:
            continue
        entry = cache.get(name)
        if entry and _fresh(entry, st):
            digest = str(entry["sha256"])
        else:
            digest = hub_blob_hash(path) or sha256_file(path, on_bytes)
            cache[name] = _entry(st, digest)
            changed = True
        out[name] = FileId(name, st.st_size, digest)
    if changed and write_cache:
        _save_cache(directory, cache)
    return out


def unhashed_bytes(directory: Path, names: Iterable[str]) -> int:
    """The bytes `manifest` would read for these files now: those whose cached hash no
    longer matches their size and mtime_ns and whose hash no hub link states."""
    cache = _load_cache(directory)
    total = 0
    for name in names:
        path = directory / name
        try:
            st = path.stat()
        except OSError:
            continue
        entry = cache.get(name)
        if not (entry and _fresh(entry, st)) and hub_blob_hash(path) is None:
            total += st.st_size
    return total


def remember(directory: Path, file: FileId) -> None:
    """Record a hash just verified (a file that landed), so nobody hashes it again."""
    st = (directory / file.name).stat()
    cache = _load_cache(directory)
    cache[file.name] = _entry(st, file.sha256)
    _save_cache(directory, cache)


def _fresh(entry: dict[str, object], st: os.stat_result) -> bool:
    """A cached hash still stands for the file while its size and mtime_ns are unchanged."""
    return entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns


def _entry(st: os.stat_result, digest: str) -> dict[str, object]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}


def free_bytes(directory: Path) -> int:
    """Free space where `directory` is or would be created (its nearest existing parent)."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    import shutil

    return shutil.disk_usage(path).free


def digest_of(files: Iterable[FileId]) -> str:
    """One SHA-256 for a set of files by name, size and content: equal sets, equal digest."""
    lines = "".join(
        f"{f.name}\t{f.size}\t{f.sha256}\n" for f in sorted(files, key=lambda f: f.name)
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def model_digest(
    directory: Path, *, write_cache: bool = True, on_progress: Hashing | None = None
) -> str:
    """The folder's manifest digest: every file in it (not hidden ones such as this
    module's cache, nor copies still in a part file). It names a model by its bytes,
    so an adapter can say which base it was trained on (see worker/finetune.py).

    `on_progress(done, total)` hears the bytes hashed, first (0, total), when there
    is anything to hash: a 700 GB model takes minutes once, then nothing (cached)."""
    names = sorted(
        p.name
        for p in directory.iterdir()
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(PART_SUFFIX)
    )
    on_bytes: Hashed | None = None
    total = unhashed_bytes(directory, names) if on_progress is not None else 0
    if on_progress is not None and total:
        done = 0
        on_progress(0, total)

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            on_progress(min(done, total), total)

    files = manifest(directory, names, write_cache=write_cache, on_bytes=on_bytes)
    return digest_of(files.values())
