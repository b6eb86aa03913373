"""Deleting a model's files on the operator's machine (the Models pane's `D`).

Whether it may be deleted is decided before (`core.model_folders.delete_refusal`:
no placement uses it, it is a model and not a model folder). A Hugging Face cache
snapshot is deleted through `huggingface_hub`'s own cache tools, which keep the
cache's refs and blobs consistent; a folder of the model folders is removed whole.
Copies on remote nodes (`studiotui fetch`, placing) are theirs and stay.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from studiotui.core.errors import StudioError
from worker.shared.manifest import in_hub_cache


class DeleteError(StudioError):
    """The files could not be removed; the message names the path."""


@dataclass(frozen=True)
class Deleted:
    path: Path
    freed: int  # bytes


def _size(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except OSError:
            continue
    return total


def delete_model(model_dir: Path) -> Deleted:
    """Remove the model at `model_dir` from this machine."""
    if not (model_dir / "config.json").is_file() and not any(model_dir.glob("*.safetensors")):
        raise DeleteError(f"{model_dir} holds no model (no config.json, no weights): not deleted")
    if in_hub_cache(model_dir):
        return _delete_snapshot(model_dir)
    freed = _size(model_dir)
    try:
        shutil.rmtree(model_dir)
    except OSError as exc:
        raise DeleteError(f"cannot delete {model_dir}: {exc}") from None
    return Deleted(model_dir, freed)


def _delete_snapshot(snapshot: Path) -> Deleted:
    """One revision of a hub repo, its blobs with it unless another revision shares them."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    cache = snapshot.parents[2]
    try:
        strategy = scan_cache_dir(cache).delete_revisions(snapshot.name)
        freed = strategy.expected_freed_size
        strategy.execute()
    except (CacheNotFound, CorruptedCacheException, OSError) as exc:
        raise DeleteError(f"cannot delete {snapshot} from the hub cache: {exc}") from None
    return Deleted(snapshot, freed)
