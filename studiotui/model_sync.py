"""Getting a placement's model files onto its nodes, the cheapest way that is correct.

For each node that needs files, in this order:
1. the node already holds them (same sizes and SHA-256) in its copy folder or, for a
   Hugging Face snapshot, at the snapshot's own path: it uses them where they are;
2. another node holds them: that node's agent serves them and the target's agent
   fetches them over the cluster addresses (`worker/files.py`); the operator's
   machine carries none of the bytes;
3. else the operator copies them over SFTP, as before.
A node's file with the right name and another hash is replaced, and the log says
which and why. Every copy lands in a part file, resumes from it, and is verified by
the node's agent before it takes the file's name. The free disk of every target is
checked before the first byte moves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studiotui import keys
from studiotui.model_files import (
    CopyPlan,
    ModelFilesError,
    NeededFile,
    copy_name,
    disk_refusal,
    hub_snapshot_path,
    local_manifest,
    plan_copy,
    send_files,
)
from worker.manifest import FileId

if TYPE_CHECKING:
    from studiotui.controller import Controller

Progress = Callable[[str, int, int], None]
STATUS_TIMEOUT_S = 60.0


class SyncRefused(RuntimeError):
    """A copy that must not start (no room, bad files); the message names the node."""


@dataclass(frozen=True)
class Source:
    node: str
    path: str  # absolute, on that node


def candidate_dirs(model_dir: Path, home: Path) -> list[str]:
    """Where a node may already hold the model, as its agent resolves them: the hub
    snapshot's path (under the node user's home when under the operator's), then the
    copy folder under the agent's work dir."""
    out = []
    hub = hub_snapshot_path(model_dir, home)
    if hub is not None:
        out.append(hub if hub.startswith("/") else f"~/{hub}")
    out.append(f"models/{copy_name(model_dir)}")
    return out


def holding(found: list[dict[str, Any]]) -> str | None:
    """The first directory of a `files_status` answer that holds every file as is."""
    for d in found:
        if all(f["state"] == "same" for f in d["files"]):
            return str(d["path"])
    return None


async def provide(
    ctl: Controller,
    model_dir: Path,
    needs: dict[str, list[NeededFile]],
    progress: Progress | None = None,
    sources: list[str] | None = None,
) -> dict[str, str]:
    """Make every node in `needs` hold its files; return where each finds the model.

    `sources`: the nodes that may serve files to others (default: every up node)."""
    union = sorted({f.name: f for fs in needs.values() for f in fs}.values(), key=lambda f: f.name)
    began, hashed = time.monotonic(), [0]
    ids = {
        f.name: f for f in await asyncio.to_thread(local_manifest, model_dir, union, hashed.append)
    }
    if sum(hashed):  # the first time only: say where the wait went
        ctl.record(
            f"hashed {sum(hashed) / 1e9:.2f} GB of {model_dir.name} in "
            f"{time.monotonic() - began:.1f} s (kept next to the files for next time)"
        )
    wanted = {node: [ids[f.name] for f in fs] for node, fs in needs.items()}
    dirs = candidate_dirs(model_dir, Path.home())
    asked = sorted(
        set(needs)
        | set(
            sources if sources is not None else (n.name for n in ctl.state.nodes if n.state == "up")
        )
    )
    replies = await asyncio.gather(
        *(_status(ctl, n, dirs, list(ids.values())) for n in asked), return_exceptions=True
    )
    status: dict[str, list[dict[str, Any]]] = {}
    for node, reply in zip(asked, replies, strict=True):
        if isinstance(reply, BaseException):
            if node in needs:
                raise reply
            continue  # a possible source that does not answer is just not a source
        status[node] = reply

    where: dict[str, str] = {}
    jobs: list[tuple[str, CopyPlan, str, Source | None]] = []
    for node, files in wanted.items():
        mine = [_only(d, files) for d in status[node]]
        held = holding(mine)
        if held is not None:
            ctl.record(f"{node} already holds {copy_name(model_dir)} at {held}: nothing copied")
            where[node] = held
            continue
        target = mine[-1]  # the copy folder
        the_plan = plan_copy(files, target)
        for name, why in the_plan.replace:
            ctl.record(f"{node}: replacing {name} in {target['path']}: {why}", "warning")
        refusal = disk_refusal(node, target["path"], the_plan.bytes_to_send, int(target["free"]))
        if refusal:
            raise SyncRefused(refusal)
        source = _source(lambda n: ctl.spec(n).is_local, node, files, status, sources)
        jobs.append((node, the_plan, str(target["path"]), source))
        where[node] = str(target["path"])

    if jobs:
        await _copy_all(ctl, model_dir, jobs, progress)
    return where


def _only(found: dict[str, Any], files: list[FileId]) -> dict[str, Any]:
    names = {f.name for f in files}
    return {**found, "files": [f for f in found["files"] if f["name"] in names]}


def _source(
    ctl_local: Callable[[str], bool],
    node: str,
    files: list[FileId],
    status: dict[str, list[dict[str, Any]]],
    sources: list[str] | None,
) -> Source | None:
    # A local node is the operator's own machine: the last choice of source.
    for other, found in sorted(status.items(), key=lambda kv: (ctl_local(kv[0]), kv[0])):
        if other == node or (sources is not None and other not in sources):
            continue
        held = holding([_only(d, files) for d in found])
        if held is not None:
            return Source(other, held)
    return None


async def _status(
    ctl: Controller, node: str, dirs: list[str], files: list[FileId]
) -> list[dict[str, Any]]:
    reply = await ctl.peer(node).request(
        "files_status", timeout=STATUS_TIMEOUT_S, dirs=dirs, files=[f.as_dict() for f in files]
    )
    return list(reply["dirs"])


async def _copy_all(
    ctl: Controller,
    model_dir: Path,
    jobs: list[tuple[str, CopyPlan, str, Source | None]],
    progress: Progress | None,
) -> None:
    """Every target at once; one grant per source node covers all its targets."""
    grants: dict[str, dict[str, Any]] = {}
    try:
        for _node, the_plan, _path, source in jobs:
            if source is None:
                continue
            grant = grants.setdefault(source.node, {"path": source.path, "files": {}})
            for f, _ in the_plan.send:
                grant["files"][f.name] = f.size
        for name, grant in grants.items():
            reply = await ctl.peer(name).request(
                "serve_files",
                dir=grant["path"],
                files=[{"name": n, "size": s} for n, s in sorted(grant["files"].items())],
            )
            grant["port"], grant["token"] = int(reply["port"]), str(reply["token"])
        results = await asyncio.gather(
            *(
                _copy(ctl, model_dir, node, the_plan, path, source, grants, progress)
                for node, the_plan, path, source in jobs
            ),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
    finally:
        for name, grant in grants.items():
            if "token" in grant:
                try:
                    await ctl.peer(name).request("unserve_files", token=grant["token"])
                except Exception as exc:  # the copy's own outcome matters more
                    ctl.record(f"{name} did not stop serving files: {exc}", "warning")


async def _copy(
    ctl: Controller,
    model_dir: Path,
    node: str,
    the_plan: CopyPlan,
    path: str,
    source: Source | None,
    grants: dict[str, dict[str, Any]],
    progress: Progress | None,
) -> None:
    total = sum(f.size for f, _ in the_plan.send)
    began = time.monotonic()
    if the_plan.resumed:
        ctl.record(f"{node}: resuming {the_plan.resumed / 1e6:.1f} MB already landed")
    if source is not None:
        grant = grants[source.node]
        endpoint = f"tcp://{ctl.spec(source.node).address}:{grant['port']}"
        received = 0
        async for msg in ctl.peer(node).stream(
            "fetch_files",
            timeout=STATUS_TIMEOUT_S,
            dir=path,
            files=[f.as_dict() for f, _ in the_plan.send],
            endpoint=endpoint,
            key=keys.node_public_key(ctl.home, source.node).decode(),
            token=grant["token"],
        ):
            if msg["type"] == "file_progress" and progress:
                progress(node, int(msg["done"]), int(msg["total"]))
            if msg["type"] == "ok":
                received = int(msg["received"])
                if progress:  # the agent's last progress may trail its answer
                    progress(node, total, total)
        how = f"from {source.node} over {endpoint.removeprefix('tcp://')}"
    else:
        received = await _sftp(ctl, model_dir, node, the_plan, path, progress)
        how = "from the operator over SFTP"
    seconds = max(time.monotonic() - began, 1e-6)
    ctl.record(
        f"copied {received / 1e6:.1f} MB of {model_dir.name} to {node} {how} "
        f"({received / 1e6 / seconds:.1f} MB/s), {total / 1e6:.1f} MB verified"
    )


async def _sftp(
    ctl: Controller,
    model_dir: Path,
    node: str,
    the_plan: CopyPlan,
    path: str,
    progress: Progress | None,
) -> int:
    from studiotui import provision

    spec = ctl.spec(node)
    if spec.is_local:
        raise ModelFilesError(f"{node} is a local node: it reads {model_dir} where it is")
    conn = await provision.connect(ctl.home, spec)
    try:
        sent = await send_files(
            conn,
            model_dir,
            path,
            the_plan.send,
            (lambda d, t: progress(node, d, t)) if progress else None,
        )
    finally:
        conn.close()
    # The agent checks each part's size and hash, then renames it into place.
    await ctl.peer(node).request(
        "files_commit",
        timeout=STATUS_TIMEOUT_S,
        dir=path,
        files=[f.as_dict() for f, _ in the_plan.send],
    )
    return sent
