"""A node downloads its share of a Hugging Face repository itself, with the hub's client.

`huggingface_hub.hf_hub_download` (mlx-lm's own dependency) puts each file in the
node's hub cache (`models--org--name/blobs` + `snapshots/<commit>`), resuming an
interrupted download from its `.incomplete` blob. Progress is read off the cache
folder (bytes of blobs, finished or not) while the client works, so it needs no
hook into the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_S = 0.5


def repo_folder(cache_dir: Path, repo: str) -> Path:
    return cache_dir / f"models--{repo.replace('/', '--')}"


def default_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_bytes(folder: Path) -> int:
    """Bytes in the repo's blobs, complete or still downloading."""
    total = 0
    with contextlib.suppress(OSError):
        for blob in (folder / "blobs").iterdir():
            with contextlib.suppress(OSError):
                total += blob.stat().st_size
    return total


def _download(
    repo: str, revision: str, files: list[str], cache_dir: Path | None, endpoint: str | None
) -> str:
    from huggingface_hub import hf_hub_download

    path = ""
    for name in files:
        path = hf_hub_download(
            repo, name, revision=revision, cache_dir=cache_dir, endpoint=endpoint
        )
    return str(Path(path).parent)


async def download(
    repo: str,
    revision: str,
    files: list[str],
    cache_dir: Path | None,
    endpoint: str | None,
    total: int,
    progress: Callable[[int, int], None],
) -> dict[str, Any]:
    """Download `files` of `repo` at `revision`; the snapshot folder they are in."""
    cache = cache_dir or default_cache()
    folder = repo_folder(cache, repo)
    before = cached_bytes(folder)
    job = asyncio.create_task(
        asyncio.to_thread(_download, repo, revision, files, cache_dir, endpoint)
    )
    while not job.done():
        progress(min(max(cached_bytes(folder) - before, 0), total), total)
        await asyncio.wait({job}, timeout=POLL_S)
    snapshot = job.result()
    progress(total, total)
    return {"path": snapshot, "downloaded": max(cached_bytes(folder) - before, 0)}
