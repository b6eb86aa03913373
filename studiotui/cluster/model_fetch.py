"""`studiotui fetch`: put a model's files on nodes ahead of placing it, each node its share.

A share is the files an even split of the layers over the group puts on a node
(`model_files.even_shares`): the small files plus the weight files its layers live in.
- A Hugging Face repository: every node downloads its share itself from the hub
  with `huggingface_hub` (`worker/hub.py`), into its hub cache, at the commit the
  operator resolved, so all nodes hold the same revision. The operator downloads
  only the small files (config, index, tokenizer: kilobytes) to work the shares out.
- A folder on the operator's machine: its shares are copied the way placing copies
  them (`model_sync`: reuse, node to node, else SFTP), verified by content.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from studiotui.cluster import model_files, model_sync
from worker.shared.manifest import in_hub_cache
from worker.shared.protocol import control

if TYPE_CHECKING:
    from studiotui.cluster.controller import Controller

Progress = Callable[[str, int, int], None]
SMALL_PATTERNS = [f"*{suffix}" for suffix in sorted(model_files.SMALL_SUFFIXES)]
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
DOWNLOAD_TIMEOUT_S = 120.0


class FetchError(RuntimeError):
    """A fetch that cannot go on; the message says what to do."""


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID.match(text)) and ".." not in text


def layers_of(model_dir: Path) -> tuple[int, bool]:
    """Number of layers and whether the head is tied to the embedding, from config.json."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise FetchError(f"{model_dir}/config.json cannot be read: {exc}") from None
    text = config.get("text_config") or {}
    n_layers = config.get("num_hidden_layers") or text.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers < 1:
        raise FetchError(f"{model_dir}/config.json has no num_hidden_layers")
    return n_layers, bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings")))


def share_names(model_dir: Path, nodes: list[str]) -> dict[str, list[str]]:
    """Each node's file names under an even split of the layers (pure but for reading
    the small files in `model_dir`)."""
    n_layers, tied = layers_of(model_dir)
    return {
        node: sorted(model_files.needed_names(model_dir, start, end, n_layers, tied))
        for node, (start, end) in model_files.even_shares(n_layers, nodes).items()
    }


async def fetch_dir(
    ctl: Controller, model_dir: Path, nodes: list[str], progress: Progress | None = None
) -> dict[str, str]:
    """Each SSH node's share of a folder of the operator's, as placing would copy it."""
    model_files.check_model_dir(model_dir)
    n_layers, tied = layers_of(model_dir)
    needs = {}
    for node, (start, end) in model_files.even_shares(n_layers, nodes).items():
        if not ctl.spec(node).is_local:
            needs[node] = model_files.needed_files(model_dir, start, end, n_layers, tied)
    where = {n: str(model_dir) for n in nodes if ctl.spec(n).is_local}
    if needs:
        where |= await model_sync.provide(ctl, model_dir, needs, progress)
    return where


def _metadata(repo: str, revision: str, endpoint: str | None) -> Path:
    """The small files of the repo at `revision`, in the operator's hub cache."""
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(repo, revision=revision, allow_patterns=SMALL_PATTERNS, endpoint=endpoint)
    )


def _sizes(repo: str, commit: str, names: list[str], endpoint: str | None) -> dict[str, int]:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    sizes = {}
    for name in names:
        meta = get_hf_file_metadata(hf_hub_url(repo, name, revision=commit, endpoint=endpoint))
        sizes[name] = int(meta.size or 0)
    return sizes


async def fetch_repo(
    ctl: Controller,
    repo: str,
    nodes: list[str],
    revision: str = "main",
    progress: Progress | None = None,
    cache_dir: str | None = None,
) -> dict[str, str]:
    """Every node downloads its share of `repo` from the hub; where each snapshot is."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        meta = await asyncio.to_thread(_metadata, repo, revision, endpoint)
    except (HfHubHTTPError, httpx.HTTPError, OSError, ValueError) as exc:
        raise FetchError(
            f"cannot read {repo}@{revision} from the hub ({endpoint or 'huggingface.co'}): "
            f"{exc}; check the name and that this machine reaches the hub"
        ) from None
    commit = meta.name
    shares = share_names(meta, nodes)
    every = sorted({n for names in shares.values() for n in names})
    sizes = await asyncio.to_thread(_sizes, repo, commit, every, endpoint)
    ctl.record(f"fetching {repo}@{commit[:12]} on {', '.join(nodes)}, each node its share")

    async def one(node: str) -> str:
        names = shares[node]
        total = sum(sizes[n] for n in names)
        path = ""
        peer = ctl.peer(node)
        async for msg in peer.stream(
            "hub_download",
            timeout=DOWNLOAD_TIMEOUT_S,
            repo=repo,
            revision=commit,
            files=names,
            total=total,
            endpoint=endpoint or "",
            cache_dir=cache_dir or "",
        ):
            if isinstance(msg, control.FileProgress):
                if progress:
                    progress(node, msg.done, msg.total)
            else:
                path = peer.read(msg, control.Downloaded).path
                if progress:
                    progress(node, total, total)
        weights = [n for n in names if n.endswith(".safetensors")]
        ctl.record(
            f"{node} downloaded its share of {repo}@{commit[:12]}: {len(weights)} weight "
            f"files, {total / 1e6:.1f} MB, into {path}",
            topic="files",
        )
        return path

    paths = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
    errors = [p for p in paths if isinstance(p, BaseException)]
    if errors:
        raise FetchError("; ".join(str(e) for e in errors))
    return {n: str(p) for n, p in zip(nodes, paths, strict=True)}


def hub_repo(model_dir: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a hub snapshot folder, None for any other folder."""
    if not in_hub_cache(model_dir):
        return None
    repo = model_dir.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return repo, model_dir.name


async def fetch_model(
    ctl: Controller, model_dir: Path, nodes: list[str], progress: Progress | None = None
) -> dict[str, str]:
    """What the Models pane's fetch does with a catalog row: a hub snapshot is
    downloaded by the nodes themselves at the same commit; a folder is sent."""
    found = hub_repo(model_dir)
    if found is not None:
        repo, commit = found
        return await fetch_repo(ctl, repo, nodes, commit, progress)
    return await fetch_dir(ctl, model_dir, nodes, progress)
