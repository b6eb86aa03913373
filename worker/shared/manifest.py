"""What a model directory holds, by content: file sizes and SHA-256 hashes.

A model is known by its bytes, not by its folder's or its files' names: a fine-tune
has the same file names and sizes as its base. Hashing hundreds of GB takes
minutes, so each directory keeps a cache (`.studiotui-manifest.json`, next to the
files) keyed by (size, mtime_ns): a second look hashes nothing. A folder that cannot
be written to (read-only, a mount, another user's) has its cache kept under
STUDIOTUI_HOME instead (`hashes/`, one file per folder, named by its absolute path). A file in a
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
# Where the hashes of folders that cannot be written to are kept, under the home
# (the same STUDIOTUI_HOME, or ~/.studiotui, as the operator's and an agent's own).
SPILL_DIR = "hashes"
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


Cache = dict[str, dict[str, object]]


def spill_path(directory: Path) -> Path:
    """Where the hashes of `directory` are kept when it cannot be written to: under
    STUDIOTUI_HOME, named by the folder's absolute path (each entry still keyed by its
    file's size and mtime_ns)."""
    home = Path(os.environ.get("STUDIOTUI_HOME") or "~/.studiotui").expanduser()
    key = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:32]
    return home / SPILL_DIR / f"{key}.json"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _load_cache(directory: Path) -> tuple[Cache, Cache]:
    """The cache beside the files, and the one kept for the folder under the home
    (only that folder's: the file says whose it is)."""
    beside = _read_json(directory / CACHE_NAME)
    spilled = _read_json(spill_path(directory))
    ok = isinstance(spilled, dict) and spilled.get("dir") == str(directory.resolve())
    files = spilled.get("files") if ok else None
    return (
        beside if isinstance(beside, dict) else {},
        files if isinstance(files, dict) else {},
    )


def _cached(caches: tuple[Cache, Cache], name: str, st: os.stat_result) -> str | None:
    """The hash a cache still holds for this file (size and mtime_ns unchanged)."""
    for cache in caches:
        entry = cache.get(name)
        if isinstance(entry, dict) and _fresh(entry, st):
            return str(entry["sha256"])
    return None


def _write(path: Path, text: str) -> bool:
    """Written atomically; False where it cannot be."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


def _save_cache(directory: Path, caches: tuple[Cache, Cache], updates: Cache) -> None:
    """Beside the files; where that cannot be written (a read-only folder), under the
    home, so the next look does not hash every byte again."""
    beside, spilled = caches
    if _write(directory / CACHE_NAME, json.dumps({**beside, **updates}, sort_keys=True)):
        return
    where = spill_path(directory)
    with contextlib.suppress(OSError):
        where.parent.mkdir(parents=True, exist_ok=True)
        body = {"dir": str(directory.resolve()), "files": {**spilled, **updates}}
        _write(where, json.dumps(body, sort_keys=True))


def manifest(
    directory: Path,
    names: Iterable[str],
    *,
    write_cache: bool = True,
    on_bytes: Hashed | None = None,
) -> dict[str, FileId]:
    """Size and hash of each named file that exists (missing ones are left out).

    A cached hash is used while the file's size and mtime_ns are unchanged."""
    caches = _load_cache(directory)
    updates: Cache = {}
    out: dict[str, FileId] = {}
    for name in names:
        path = directory / name
        try:
            st = path.stat()
        except OSError:
            continue
        digest = _cached(caches, name, st)
        if digest is None:
            digest = hub_blob_hash(path) or sha256_file(path, on_bytes)
            updates[name] = _entry(st, digest)
        out[name] = FileId(name, st.st_size, digest)
    if updates and write_cache:
        _save_cache(directory, caches, updates)
    return out


def unhashed_bytes(directory: Path, names: Iterable[str]) -> int:
    """The bytes `manifest` would read for these files now: those whose cached hash no
    longer matches their size and mtime_ns and whose hash no hub link states."""
    caches = _load_cache(directory)
    total = 0
    for name in names:
        path = directory / name
        try:
            st = path.stat()
        except OSError:
            continue
        if _cached(caches, name, st) is None and hub_blob_hash(path) is None:
            total += st.st_size
    return total


def remember(directory: Path, file: FileId) -> None:
    """Record a hash just verified (a file that landed), so nobody hashes it again."""
    st = (directory / file.name).stat()
    _save_cache(directory, _load_cache(directory), {file.name: _entry(st, file.sha256)})


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
