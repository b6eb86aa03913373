"""Bringing a fine-tuning job's adapter from its node back to the operator.

A finetune job saves its adapter on the nodes (`jobs/NAME/adapters` under each node's
agent home; every rank saves the same one). To place it with its base, or fuse it,
the operator needs it in a folder the adapter catalog reads: it is copied from the
job's rank-0 node to `STUDIOTUI_HOME/adapters/NAME`. Only mlx-lm's two adapter files
travel (`adapter_config.json`, `adapters.safetensors`), not the checkpoints the job
keeps for `--resume`.

The bytes go the ways model files go: over SFTP from an SSH node (`ssh.get_files`),
or straight from the folder of a node on this machine. The node's agent names each
file's size and SHA-256 first (`files_status`, the message placements use), so a
missing adapter is refused before anything moves; what lands goes to a staging
folder and takes the catalog's name only after its hashes match the node's, it reads
as an adapter (`worker.shared.adapters.read_adapter`) and its stamp names the job's
base (`identity_mismatch` against the model, or the digest the job recorded).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

from studiotui.cluster.hub import Cluster
from studiotui.cluster.jobs import JobRecord
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.core.adapter_catalog import ADAPTERS_FOLDER
from studiotui.core.errors import StudioError
from studiotui.core.state import node_start_hint
from studiotui.ssh import nodes
from studiotui.ssh.client import SshError, get_files
from worker.shared.adapters import FILES, Adapter, AdapterError, identity_mismatch, read_adapter
from worker.shared.manifest import FileId, manifest, sha256_file
from worker.shared.protocol import control

STATUS_TIMEOUT_S = 60.0
FINETUNE = "finetune"  # the job kind that saves an adapter (worker.jobs.KINDS)
Progress = Callable[[str, int, int], None] | None  # node, bytes done, bytes total


class AdapterFetchError(StudioError):
    """A job's adapter that cannot be brought here; nothing was kept."""


def job_adapter_dir(job: str) -> str:
    """Where a job's adapter is on a node, relative to its agent home (worker/finetune.py)."""
    return f"jobs/{job}/adapters"


def fetched_dir(home: Path, job: str) -> Path:
    """Where a job's adapter is kept on the operator: a folder the catalog scans, named
    after the job (so `place --adapter NAME` finds it by the job's name)."""
    return home / ADAPTERS_FOLDER / job


def node_files(found: control.DirStatus) -> dict[str, FileId]:
    """The adapter files a `files_status` answer says the node holds, by name."""
    return {
        f.name: FileId(f.name, f.size, f.sha256)
        for f in found.files
        if f.sha256 and f.size is not None
    }


def up_to_date(local_dir: Path, wanted: dict[str, FileId]) -> bool:
    """Whether the operator's copy already holds exactly the node's files."""
    if not local_dir.is_dir():
        return False
    have = manifest(local_dir, list(wanted))
    return all(have.get(n) == f for n, f in wanted.items())


async def fetch_adapter(ctl: Cluster, record: JobRecord, progress: Progress = None) -> Path:
    """The job's adapter in `STUDIOTUI_HOME/adapters/NAME`, copied from its rank-0 node
    if the operator's copy is missing or differs from it; verified, or refused."""
    name, node = record.name, record.nodes[0]
    if record.kind != FINETUNE:
        raise AdapterFetchError(f"job {name} is a {record.kind} job: it saves no adapter")
    state = ctl.state.node(node)
    if state is None or state.state != "up":
        raise AdapterFetchError(
            f"job {name}'s adapter is on {node} (its rank 0), which is "
            f"{state.state if state else 'not in the inventory'}",
            f"{node_start_hint(node)}, then: studiotui jobs fetch {name}",
        )
    try:
        reply = await ctl.peer(node).ask(
            "files_status",
            control.FilesFound,
            timeout=STATUS_TIMEOUT_S,
            dirs=[job_adapter_dir(name)],
            files=[FileId(n, 0, "").as_dict() for n in FILES],
        )
    except (AgentUnreachable, AgentError) as exc:
        raise AdapterFetchError(
            f"{node} did not say what job {name} saved: {exc}",
            f"check the node (studiotui status), then: studiotui jobs fetch {name}",
        ) from None
    if not reply.dirs:
        raise AdapterFetchError(f"{node} answered files_status without the folder asked")
    found = reply.dirs[0]
    wanted = node_files(found)
    missing = [n for n in FILES if n not in wanted]
    if missing:
        raise AdapterFetchError(
            f"job {name} has no saved adapter on {node} yet ({missing[0]} is not in {found.path})",
            f"it saves one every --save-every iterations and when it ends: follow it "
            f"(studiotui jobs follow {name}), then: studiotui jobs fetch {name}",
        )
    target = fetched_dir(ctl.home, name)
    if await asyncio.to_thread(up_to_date, target, wanted):
        ctl.record(f"adapter {name} is already here ({target}), as on {node}: nothing copied")
        return target
    staging = target.with_name(f".{name}.fetching")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        how = await _copy(ctl, node, Path(found.path), staging, wanted, progress)
        await asyncio.to_thread(_verify, staging, wanted, record)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.size for f in wanted.values())
    ctl.record(
        f"fetched the adapter of job {name} from {node} {how} to {target} "
        f"({size / 1e6:.1f} MB, sha256 verified)"
    )
    return target


async def _copy(
    ctl: Cluster,
    node: str,
    remote: Path,
    staging: Path,
    wanted: dict[str, FileId],
    progress: Progress,
) -> str:
    total = sum(f.size for f in wanted.values())
    spec = ctl.spec(node)
    if spec.is_local:  # the node's folder is on this machine
        for n in wanted:
            await asyncio.to_thread(shutil.copyfile, remote / n, staging / n)
        return "(a node on this machine)"
    try:
        conn = await nodes.connect_node(spec, ctl.home)
        try:
            await get_files(
                conn,
                {(remote / n).as_posix(): staging / n for n in wanted},
                (lambda done: progress(node, done, total)) if progress else None,
            )
        finally:
            conn.close()
    except SshError as exc:
        raise AdapterFetchError(str(exc), exc.hint) from None
    return "over SFTP"


def _verify(staging: Path, wanted: dict[str, FileId], record: JobRecord) -> Adapter:
    """Every file as the node hashed it, an adapter mlx-lm can load, of the job's base."""
    for n, f in wanted.items():
        path = staging / n
        size = path.stat().st_size
        digest = sha256_file(path)
        if size != f.size or digest != f.sha256:
            raise AdapterFetchError(
                f"{n} of job {record.name} arrived as {size} B, sha256 {digest[:12]}; the node "
                f"holds {f.size} B, sha256 {f.sha256[:12]} (was it saving just then?)",
                f"fetch it again: studiotui jobs fetch {record.name}",
            )
    try:
        adapter = read_adapter(staging)
    except AdapterError as exc:
        raise AdapterFetchError(f"job {record.name}'s adapter: {exc}") from None
    model = Path(str(record.request.get("model", "")))
    base = record.request.get("base") or {}
    if record.request.get("model") and (model / "config.json").is_file():
        reason = identity_mismatch(adapter, model)
    elif adapter.base is None or adapter.base.digest != base.get("digest"):
        reason = f"adapter of job {record.name} is not stamped with the base the job trained"
    else:
        reason = None
    if reason:
        raise AdapterFetchError(f"not kept: {reason}")
    return adapter
