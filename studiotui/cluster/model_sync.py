"""Getting a placement's model files onto its nodes, the cheapest way that is correct.

For each node that needs files, in this order:
1. the node already holds them (same sizes and SHA-256) in its copy folder or, for a
   Hugging Face snapshot, at the snapshot's own path: it uses them where they are;
2. other nodes hold them (each file by its content, wherever it is): their agents
   serve them and the target's agent fetches them over the cluster addresses
   (`worker/files.py`); the operator's machine carries none of the bytes;
3. the files no node holds, the operator copies over SFTP, as before.
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
from typing import Any

from studiotui.cluster import keys
from studiotui.cluster.hub import Cluster
from studiotui.cluster.model_files import (
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
from studiotui.ssh import nodes
from worker.shared.manifest import FileId, Hashing, unhashed_bytes
from worker.shared.protocol import control
from worker.shared.protocol.control import DirStatus

Progress = Callable[[str, int, int], None]
STATUS_TIMEOUT_S = 60.0


class SyncRefused(RuntimeError):
    """A copy that must not start (no room, bad files); the message names the node."""


@dataclass(frozen=True)
class Source:
    node: str
    path: str  # absolute, on that node


def candidate_dirs(model_dir: Path, home: Path, folder: str | None = None) -> list[str]:
    """Where a node may already hold the model, as its agent resolves them: the hub
    snapshot's path (under the node user's home when under the operator's), then the
    copy folder under the agent's work dir (`folder`, else named after the model)."""
    out = []
    hub = hub_snapshot_path(model_dir, home)
    if hub is not None:
        out.append(hub if hub.startswith("/") else f"~/{hub}")
    out.append(f"models/{folder or copy_name(model_dir)}")
    return out


def holding(found: list[DirStatus]) -> str | None:
    """The first directory of a `files_status` answer that holds every file as is."""
    for d in found:
        if all(f.state == "same" for f in d.files):
            return d.path
    return None


async def provide(
    ctl: Cluster,
    model_dir: Path,
    needs: dict[str, list[NeededFile]],
    progress: Progress | None = None,
    sources: list[str] | None = None,
    folder: str | None = None,
    hashing: Hashing | None = None,
) -> dict[str, str]:
    """Make every node in `needs` hold its files; return where each finds the model.

    `sources`: the nodes that may serve files to others (default: every up node).
    `folder`: the copy folder's name under the node's `models/` (default: the model's;
    an adapter's names its content, since mlx-lm names every adapter folder alike).
    `hashing(done, total)` hears, from a worker thread, the first hashing of the files
    (every byte read once; cached beside them after), which the copy is checked by."""
    union = sorted({f.name: f for fs in needs.values() for f in fs}.values(), key=lambda f: f.name)
    began, hashed = time.monotonic(), [0]
    total = unhashed_bytes(model_dir, [f.name for f in union]) if hashing is not None else 0

    def counted(n: int) -> None:
        hashed[0] += n
        if hashing is not None and total:
            hashing(min(hashed[0], total), total)

    def manifest() -> list[FileId]:
        # Its start is said from the thread too: a listener redrawing from the loop
        # (call_from_thread) must hear every report from one side.
        if hashing is not None and total:
            hashing(0, total)
        return local_manifest(model_dir, union, counted)

    ids = {f.name: f for f in await asyncio.to_thread(manifest)}
    if hashed[0]:  # the first time only: say where the wait went
        ctl.record(
            f"hashed {hashed[0] / 1e9:.2f} GB of {model_dir.name} in "
            f"{time.monotonic() - began:.1f} s (kept next to the files for next time)"
        )
    wanted = {node: [ids[f.name] for f in fs] for node, fs in needs.items()}
    dirs = candidate_dirs(model_dir, Path.home(), folder)
    asked = sorted(
        set(needs)
        | set(
            sources if sources is not None else (n.name for n in ctl.state.nodes if n.state == "up")
        )
    )
    replies = await asyncio.gather(
        *(_status(ctl, n, dirs, list(ids.values())) for n in asked), return_exceptions=True
    )
    status: dict[str, list[DirStatus]] = {}
    for node, reply in zip(asked, replies, strict=True):
        if isinstance(reply, BaseException):
            if node in needs:
                raise reply
            continue  # a possible source that does not answer is just not a source
        status[node] = reply

    def ctl_local(name: str) -> bool:
        return ctl.spec(name).is_local

    where: dict[str, str] = {}
    jobs: list[Job] = []
    for node, files in wanted.items():
        mine = [d.only({f.name for f in files}) for d in status[node]]
        held = holding(mine)
        if held is not None:
            ctl.record(
                f"{node} already holds {folder or copy_name(model_dir)} at {held}: nothing copied"
            )
            where[node] = held
            continue
        target = mine[-1]  # the copy folder
        the_plan = plan_copy(files, target)
        for name, why in the_plan.replace:
            ctl.record(f"{node}: replacing {name} in {target.path}: {why}", "warning")
        refusal = disk_refusal(node, target.path, the_plan.bytes_to_send, target.free)
        if refusal:
            raise SyncRefused(refusal)
        holders = file_sources(node, [f.name for f, _ in the_plan.send], status, sources, ctl_local)
        jobs.append(Job(node, the_plan, target.path, holders))
        where[node] = target.path

    if jobs:
        await _copy_all(ctl, model_dir, jobs, progress)
    return where


@dataclass(frozen=True)
class Job:
    node: str
    plan: CopyPlan
    path: str  # the target's copy folder (absolute, on the node)
    sources: dict[str, Source | None]  # file -> who sends it (None: the operator)

    def groups(self) -> dict[Source | None, list[tuple[FileId, int]]]:
        out: dict[Source | None, list[tuple[FileId, int]]] = {}
        for f, offset in self.plan.send:
            out.setdefault(self.sources.get(f.name), []).append((f, offset))
        return out


def file_sources(
    node: str,
    names: list[str],
    status: dict[str, list[DirStatus]],
    sources: list[str] | None,
    is_local: Callable[[str], bool],
) -> dict[str, Source | None]:
    """For each file, a node (and folder) that holds it as is, else None (the operator).

    Per file, so a target whose files are spread over several nodes (an even `fetch`
    split, then a placement with other cuts) still gets them all from nodes. A node
    on the operator's machine (local) is the last choice."""
    order = sorted(status, key=lambda n: (is_local(n), n))
    found: dict[str, Source | None] = {}
    for name in names:
        found[name] = None
        for other in order:
            if other == node or (sources is not None and other not in sources):
                continue
            held = [
                d.path
                for d in status[other]
                if any(f.name == name and f.state == "same" for f in d.files)
            ]
            if held:
                found[name] = Source(other, held[0])
                break
    return found


async def _status(ctl: Cluster, node: str, dirs: list[str], files: list[FileId]) -> list[DirStatus]:
    reply = await ctl.peer(node).ask(
        "files_status",
        control.FilesFound,
        timeout=STATUS_TIMEOUT_S,
        dirs=dirs,
        files=[f.as_dict() for f in files],
    )
    return reply.dirs


async def _copy_all(
    ctl: Cluster,
    model_dir: Path,
    jobs: list[Job],
    progress: Progress | None,
) -> None:
    """Every target at once; one grant per source folder covers all its targets."""
    grants: dict[Source, dict[str, Any]] = {}
    try:
        for job in jobs:
            for source, files in job.groups().items():
                if source is not None:
                    grant = grants.setdefault(source, {"files": {}})
                    grant["files"].update({f.name: f.size for f, _ in files})
        for source, grant in grants.items():
            reply = await ctl.peer(source.node).ask(
                "serve_files",
                control.Granted,
                dir=source.path,
                files=[{"name": n, "size": s} for n, s in sorted(grant["files"].items())],
            )
            grant["port"], grant["token"] = reply.port, reply.token
        results = await asyncio.gather(
            *(_copy(ctl, model_dir, job, grants, progress) for job in jobs),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
    finally:
        for source, grant in grants.items():
            if "token" in grant:
                try:
                    await ctl.peer(source.node).request("unserve_files", token=grant["token"])
                except Exception as exc:  # the copy's own outcome matters more
                    ctl.record(f"{source.node} did not stop serving files: {exc}", "warning")


async def _copy(
    ctl: Cluster,
    model_dir: Path,
    job: Job,
    grants: dict[Source, dict[str, Any]],
    progress: Progress | None,
) -> None:
    """A target's files from each of their sources at once, progress summed."""
    total = sum(f.size for f, _ in job.plan.send)
    done: dict[Source | None, int] = {}

    def step(source: Source | None, bytes_done: int) -> None:
        done[source] = bytes_done
        if progress:
            progress(job.node, sum(done.values()), total)

    if job.plan.resumed:
        ctl.record(f"{job.node}: resuming {job.plan.resumed / 1e6:.1f} MB already landed")
    await asyncio.gather(
        *(
            _from(ctl, model_dir, job, source, files, grants, step)
            for source, files in job.groups().items()
        )
    )


async def _from(
    ctl: Cluster,
    model_dir: Path,
    job: Job,
    source: Source | None,
    files: list[tuple[FileId, int]],
    grants: dict[Source, dict[str, Any]],
    step: Callable[[Source | None, int], None],
) -> None:
    began = time.monotonic()
    size = sum(f.size for f, _ in files)
    if source is not None:
        grant = grants[source]
        endpoint = f"tcp://{ctl.spec(source.node).address}:{grant['port']}"
        received = 0
        peer = ctl.peer(job.node)
        async for msg in peer.stream(
            "fetch_files",
            timeout=STATUS_TIMEOUT_S,
            dir=job.path,
            files=[f.as_dict() for f, _ in files],
            endpoint=endpoint,
            key=keys.node_public_key(ctl.home, source.node).decode(),
            token=grant["token"],
        ):
            if isinstance(msg, control.FileProgress):
                step(source, msg.done)
            else:
                received = peer.read(msg, control.Fetched).received
                step(source, size)  # the agent's last progress may trail its answer
        how = f"from {source.node} over {endpoint.removeprefix('tcp://')}"
    else:
        received = await _sftp(ctl, model_dir, job, files, lambda d: step(None, d))
        how = "from the operator over SFTP"
    seconds = max(time.monotonic() - began, 1e-6)
    ctl.record(
        f"copied {received / 1e6:.1f} MB of {model_dir.name} to {job.node} {how} "
        f"({received / 1e6 / seconds:.1f} MB/s), {len(files)} files, {size / 1e6:.1f} MB verified",
        topic="files",
    )


async def _sftp(
    ctl: Cluster,
    model_dir: Path,
    job: Job,
    files: list[tuple[FileId, int]],
    step: Callable[[int], None],
) -> int:
    spec = ctl.spec(job.node)
    if spec.is_local:
        raise ModelFilesError(f"{job.node} is a local node: it reads {model_dir} where it is")
    conn = await nodes.connect_node(spec, ctl.home)
    try:
        sent = await send_files(conn, model_dir, job.path, files, lambda d, _t: step(d))
    finally:
        conn.close()
    # The agent checks each part's size and hash, then renames it into place.
    await ctl.peer(job.node).request(
        "files_commit",
        timeout=STATUS_TIMEOUT_S,
        dir=job.path,
        files=[f.as_dict() for f, _ in files],
    )
    return sent
