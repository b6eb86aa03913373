"""Fine-tuning a model with LoRA (QLoRA on a quantized one) across a node group.

`prepare` checks everything a job needs before anything expensive happens (the
model, the nodes, every line of the data, that the data fills a batch on every
node) and deals the data out per rank; `launch` puts the model and each node's data
share on the nodes the way placements get model files (`model_sync.provide`, by
content; a local node reads the operator's folder), then starts one rank per node
(`cluster.jobs.start_group`); `attach` follows a job — just started, or found running
after a restart — into a `JobWatch`. The training itself is mlx-lm's
(worker/finetune.py).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from studiotui.cluster import jobs, model_files, model_sync
from studiotui.cluster.hub import Cluster
from studiotui.core.errors import StudioError
from studiotui.core.forecast import links_from_state
from studiotui.core.jobs import JobWatch
from studiotui.core.members import group_backend
from studiotui.core.model_facts import ModelDirError, ModelInfo, read_model
from studiotui.core.state import node_start_hint
from studiotui.tune.data import (
    Examples,
    check_counts,
    deal,
    deal_valid,
    load_examples,
    write_shares,
)
from worker.shared.adapters import identity_of
from worker.shared.manifest import Hashing
from worker.shared.protocol import control

KIND = "finetune"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
OPTIMIZERS = ("adam", "adamw", "sgd")
Progress = Callable[[str, int, int], None]


class FinetuneError(StudioError, ValueError):
    pass


@dataclass(frozen=True)
class FinetuneRequest:
    model: str  # the model directory on the operator's machine
    data: str
    nodes: tuple[str, ...]
    name: str
    iters: int = 100
    lora_rank: int = 8
    batch_size: int = 8  # the global batch, split evenly over the nodes
    learning_rate: float = 1e-5
    num_layers: int = 16
    optimizer: str = "adam"
    seed: int = 0
    save_every: int = 50
    steps_per_eval: int = 50
    max_seq_length: int = 2048
    val_batches: int = 25

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FinetuneRequest:
        fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "nodes": tuple(fields.get("nodes", ()))})


@dataclass(frozen=True)
class Prepared:
    request: FinetuneRequest
    info: ModelInfo
    examples: Examples
    backend: str
    backend_reason: str
    method: str  # LoRA or QLoRA
    data_dir: Path  # the dealt shares, on the operator's machine
    devices: list[list[str | None]] | None = None  # JACCL's device matrix (rank order)


def data_folder(home: Path, name: str) -> Path:
    # Its folder name is what a node's copy is called (models/<name>.training-data).
    return jobs.records_dir(home) / f"{name}.training-data"


def check_request(req: FinetuneRequest) -> None:
    if not _NAME.match(req.name):
        raise FinetuneError(
            f"job name {req.name!r} must be 1-64 letters, digits, '.', '_' or '-'",
            "pick another --name",
        )
    for label, value in (
        ("--iters", req.iters),
        ("--rank", req.lora_rank),
        ("--batch-size", req.batch_size),
        ("--layers", req.num_layers),
    ):
        if value < 1:
            raise FinetuneError(f"{label} must be at least 1, got {value}")
    # NaN passes a plain `<= 0` and would train a NaN adapter to the end.
    if not (math.isfinite(req.learning_rate) and req.learning_rate > 0):
        raise FinetuneError(
            f"--learning-rate must be a number above 0, got {req.learning_rate}",
            "e.g. 1e-5 (the default) to 1e-3",
        )
    if req.optimizer not in OPTIMIZERS:
        raise FinetuneError(f"unknown optimizer {req.optimizer!r}; use {', '.join(OPTIMIZERS)}")
    if not req.nodes:
        raise FinetuneError("no nodes to train on", "name a group or nodes with --nodes")


def prepare(ctl: Cluster, req: FinetuneRequest, *, resuming: bool = False) -> Prepared:
    """Everything checked, the data dealt into `data_folder`; nothing sent anywhere yet."""
    check_request(req)
    existing = jobs.load_record(ctl.home, req.name)
    if existing is not None and not resuming:
        raise FinetuneError(
            f"a job named {req.name!r} exists",
            f"resume it (studiotui finetune --resume {req.name}) or pick another --name",
        )
    model_dir = Path(req.model).expanduser()
    if not model_dir.is_dir():
        raise FinetuneError(f"model directory {model_dir} does not exist")
    try:
        model_files.check_model_dir(model_dir)
        info = read_model(model_dir)
    except ModelDirError as exc:
        raise FinetuneError(str(exc)) from None
    if info.unsupported:
        raise FinetuneError(f"{info.name} cannot be trained here: {info.unsupported}")
    for node in req.nodes:
        state = ctl.state.node(node)
        if state is None:
            known = ", ".join(n.name for n in ctl.state.nodes)
            raise FinetuneError(f"unknown node {node!r}", f"known: {known}")
        if state.state != "up":
            raise FinetuneError(f"{node} is {state.state}", node_start_hint(node))
    examples = load_examples(Path(req.data), seed=req.seed, least=req.batch_size)
    check_counts(examples, req.batch_size, len(req.nodes))
    # JACCL when every pair is joined by an active RDMA cable (with the device matrix
    # the ranks need); else the ring over the bridge addresses, with the reason.
    chosen = group_backend(list(req.nodes), links_from_state(ctl.state), _rdma(ctl, req.nodes))
    folder = data_folder(ctl.home, req.name)
    size = len(req.nodes)
    write_shares(
        folder, deal(examples.train, req.batch_size, size), deal_valid(examples.valid, size)
    )
    method = "QLoRA" if info.quantization else "LoRA"
    return Prepared(
        req, info, examples, chosen.backend, chosen.reason, method, folder, chosen.devices
    )


def _rdma(ctl: Cluster, nodes: Sequence[str]) -> dict[str, Any]:
    return {n: s.facts.get("rdma") for n in nodes if (s := ctl.state.node(n)) is not None}


async def _where(
    ctl: Cluster,
    source: Path,
    needs: dict[str, list[model_files.NeededFile]],
    progress: Any,
    hashing: Hashing | None = None,
) -> dict[str, str]:
    """Where each node reads `source`: the operator's own folder on a local node, else a
    copy made (or found) by content, as placements get model files (`hashing` hears
    the files' first hashing, which only a copy needs)."""
    where = {n: str(source) for n in needs if ctl.spec(n).is_local}
    remote = {n: files for n, files in needs.items() if n not in where}
    if remote:
        try:
            where |= await model_sync.provide(ctl, source, remote, progress, hashing=hashing)
        except (model_sync.SyncRefused, model_files.ModelFilesError) as exc:
            raise FinetuneError(str(exc)) from None
    return where


async def launch(
    ctl: Cluster,
    prepared: Prepared,
    *,
    resume: bool = False,
    progress: Progress | None = None,
    hashing: Hashing | None = None,
) -> jobs.JobRecord:
    """Put the model and each rank's data on the nodes and start the ranks. `hashing`
    hears the base's first hashing in bytes (its identity, stamped into the adapter,
    and the files' hashes a copy to a remote node is made and checked by); `progress`
    each node's copy (node, bytes, of)."""
    req, info = prepared.request, prepared.info
    if resume:
        # Refused before anything is hashed or copied: a rerun with nothing to train
        # would replace the job's record on the nodes (its losses) with an empty one.
        ranks = (await jobs.status(ctl, list(req.nodes))).get(req.name, {})
        running = sorted(n for n, r in ranks.items() if r.state in RUNNING)
        if running:
            raise FinetuneError(
                f"job {req.name!r} still runs on {', '.join(running)}",
                f"stop it first (studiotui jobs stop {req.name}), or watch it "
                f"(studiotui jobs follow {req.name})",
            )
        trained = trained_through(ranks.values())
        if trained is not None and req.iters <= trained:
            raise FinetuneError(
                f"job {req.name!r} is done: its {trained} iterations are trained, "
                "nothing to resume",
                f"to train on, give it more: studiotui finetune --resume {req.name} "
                f"--iters N (N above {trained})",
            )
    model_dir = Path(req.model).expanduser().resolve()
    nodes = list(req.nodes)
    # The adapters' own identity of a base (worker.shared.adapters), checked when placed.
    # Hashed first, where `hashing` shows it: the copy's manifest below then finds every
    # file's hash cached beside it instead of reading the base again unseen.
    base = (await asyncio.to_thread(identity_of, model_dir, hashing)).as_dict()
    # Every node trains the whole model: all its files (layers [0, n)).
    whole = model_files.needed_files(model_dir, 0, info.n_layers, info.n_layers, False)
    # Hashed just above, so nothing here, unless its folder keeps no hashes (a read-only
    # one): then the copy's hashing is shown as well.
    model_where = await _where(ctl, model_dir, {n: whole for n in nodes}, progress, hashing)

    def share(rank: int) -> list[model_files.NeededFile]:
        names = (f"rank{rank}.train.jsonl", f"rank{rank}.valid.jsonl")
        return [model_files.NeededFile(n, (prepared.data_dir / n).stat().st_size) for n in names]

    # Each node gets only its own share of the data.
    shares = {n: share(i) for i, n in enumerate(nodes)}
    data_where = await _where(ctl, prepared.data_dir, shares, progress)
    # A report (losses and rates summed over the group) every step of a short job, every
    # tenth at most on a long one: the plot's points, and how fast a save can follow.
    steps_per_report = max(1, min(10, req.iters // 100))
    specs = [
        {
            "model_dir": model_where[n],
            "data_dir": data_where[n],
            "train_file": f"rank{i}.train.jsonl",
            "valid_file": f"rank{i}.valid.jsonl" if prepared.examples.valid else "",
            "iters": req.iters,
            "batch_size": req.batch_size,
            "lora_rank": req.lora_rank,
            "learning_rate": req.learning_rate,
            "num_layers": req.num_layers,
            "optimizer": req.optimizer,
            "seed": req.seed,
            "save_every": max(steps_per_report, req.save_every),
            "steps_per_report": steps_per_report,
            "steps_per_eval": req.steps_per_eval,
            "max_seq_length": req.max_seq_length,
            "val_batches": req.val_batches,
            "base": base,
            "resume": resume,
        }
        for i, n in enumerate(nodes)
    ]
    record = jobs.JobRecord(
        req.name,
        KIND,
        tuple(nodes),
        prepared.backend,
        started=time.time(),
        request={**req.to_json(), "method": prepared.method, "base": base},
    )
    jobs.save_record(ctl.home, record)
    await jobs.start_group(ctl, record, specs, devices=prepared.devices)
    ctl.record(
        f"fine-tuning {info.name} ({prepared.method}, rank {req.lora_rank}) as {req.name!r} "
        f"on {', '.join(nodes)}: {prepared.backend_reason}"
    )
    return record


RUNNING = ("starting", "running", "silent")  # a rank's states before it ends


def jobs_ended_by(
    found: Mapping[str, Mapping[str, control.JobRank]], nodes: Iterable[str]
) -> dict[str, list[str]]:
    """The jobs that stopping the agents of `nodes` would end (`found` as
    `jobs.status` gives it): job -> its running ranks among `nodes`. One rank stopped
    ends a job on every node, so any running rank there counts."""
    names = set(nodes)
    ending = {
        job: sorted(n for n, rank in ranks.items() if n in names and rank.state in RUNNING)
        for job, ranks in sorted(found.items())
    }
    return {job: where for job, where in ending.items() if where}


async def jobs_on(ctl: Cluster, nodes: Sequence[str]) -> dict[str, list[str]]:
    """`jobs_ended_by`, asked of the agents of `nodes` (one that does not answer runs
    nothing that a restart could end)."""
    return jobs_ended_by(await jobs.status(ctl, list(nodes)), nodes) if nodes else {}


def trained_through(ranks: Iterable[control.JobRank]) -> int | None:
    """The iteration a job finished at, when every rank reported it finished; else
    None (stopped, failed or still running: there is something to resume)."""
    reached = [r.latest.get("finished", {}).get("iteration") for r in ranks]
    if not reached or not all(isinstance(i, int) for i in reached):
        return None
    return min(cast(list[int], reached))


def resume_request(ctl: Cluster, name: str) -> FinetuneRequest:
    record = jobs.load_record(ctl.home, name)
    if record is None or record.kind != KIND:
        known = ", ".join(r.name for r in jobs.all_records(ctl.home) if r.kind == KIND) or "none"
        raise FinetuneError(f"no fine-tuning job named {name!r}", f"known: {known}")
    return FinetuneRequest.from_json(record.request)


async def attach(
    ctl: Cluster,
    record: jobs.JobRecord,
    watch: JobWatch,
    on_change: Callable[[], None] | None = None,
) -> jobs.JobEnd:
    """Follow a job to its end, feeding `watch` (from what it has seen already)."""

    def event(node: str, body: dict[str, Any]) -> None:
        watch.feed(node, body)
        if on_change is not None:
            on_change()

    def beat(node: str, state: str, message: str) -> None:
        watch.beat(node, state, message)
        if on_change is not None:
            on_change()

    since = {n: watch.since(n) for n in record.nodes}
    end = await jobs.follow(ctl, record.name, list(record.nodes), event, since, beat)
    watch.finish(end.state, end.message)
    if on_change is not None:
        on_change()
    return end
