"""Typed control messages: what an agent is asked, what it answers, what it publishes.

`messages.decode` checks the envelope (version, type, the fields every message of a
type must have); `parse` turns a decoded map into one of these frozen structs,
checking every field it reads — optional ones too, and nested ones (a shard report
inside telemetry, a peer inside measure_links) — so a read site never re-reads a
`dict[str, Any]` with `.get()` and a default. A field of the wrong type, or a
status no one knows, raises `MessageError` naming the message, the field and what
was expected: the agent answers it with an error, the controller counts it dropped.

Fields a message carries that a struct does not name are ignored (a newer peer may
send more). The structs are msgspec's: `msgspec.convert` does the checking, in C.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from worker.shared.manifest import FileId
from worker.shared.protocol.limits import DEFAULT_STREAMS
from worker.shared.protocol.messages import MessageError
from worker.shared.protocol.status import FileState, ShardStatus

T = TypeVar("T")


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """A control message as its reader sees it (unknown fields are ignored)."""


def parse(raw: Any, kind: type[T]) -> T:
    """`raw` (a decoded message, or a part of one) as a `kind`, or MessageError."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        what = raw.get("type") if isinstance(raw, Mapping) else None
        raise MessageError(f"{what or kind.__name__}: {exc}") from None


def to_wire(struct: Wire) -> dict[str, Any]:
    """A struct's fields as the plain map msgpack sends."""
    out: dict[str, Any] = msgspec.to_builtins(struct)
    return out


# ---- controller -> agent --------------------------------------------------------------


# A prepared shard holds its plan's memory (promised to every operator) while its
# files are copied, which may take hours; its controller renews it every 30 s
# (studiotui.cluster.controller.LEASE_RENEW_EVERY_S). Unrenewed this long, ten renewals
# missed (far past a stalled copy chunk or a busy operator), the operator went away
# mid-copy (killed, its laptop closed): the shard is dropped so its memory is free
# again, rather than held until someone unloads it by name.
PREPARED_LEASE_S = 300.0

# How long the ranks of an `mx.distributed` group wait for one another to start before
# they give up naming who did not come (worker.group.meet). Each rank is a process that
# imports MLX and mlx-lm first: seconds on an idle Mac, far more on a loaded one, so
# minutes, not MLX's own connect retries (about 15 s to its last attempt). The operator
# sends it with each member's load (TensorMember.join_s) and waits on the agents'
# heartbeats meanwhile.
GROUP_JOIN_S = 300.0
# Where that time is set: the operator's environment (for `studiotui place` and the
# dashboard), and a rank's, from its load (worker.group.rank_env).
JOIN_S_VAR = "STUDIOTUI_JOIN_S"


class PrepareShard(Wire, frozen=True, kw_only=True):
    placement: str
    # A shard reloaded after a restart asks for the ports it had (None: any free ones).
    data_port: int | None = None
    client_port: int | None = None
    tensor: bool = False  # a member of a tensor-parallel stage: a port for its group too
    # The plan's memory for this shard (weights, KV reserve, adapter share), promised
    # from now, through the copy of its files, until it is loaded: the agent reports
    # it with the shard, so every operator (another CLI, a restarted TUI) sees it
    # taken (controller.committed_bytes) while the node's own reports do not show it yet.
    weight_bytes: int = 0
    kv_bytes: int = 0
    adapter_bytes: int = 0
    prompt_cache_bytes: int = 0  # the plan's prompt-cache budget for this shard
    # How long the shard stays prepared unless its controller renews it (renew_shards);
    # None: PREPARED_LEASE_S. A lapsed one is dropped.
    lease_s: float | None = None


class RenewShards(Wire, frozen=True, kw_only=True):
    """The placing controller's "still copying": the leases of these placements'
    prepared shards start again (a shard loading or loaded has none)."""

    placements: list[str]


class Renewed(Wire, frozen=True, kw_only=True):
    """The placements whose prepared shard here was renewed (others are not prepared
    here any more: loaded, unloaded, or dropped when their lease lapsed)."""

    placements: list[str]


class LoadShard(Wire, frozen=True, kw_only=True):
    placement: str
    model_dir: str
    start: int
    end: int
    index: int
    count: int
    data_port: int
    client_port: int
    next_endpoint: str
    next_key: str
    prefill_chunk: int = 512
    context_tokens: int = 4096
    streams: int = DEFAULT_STREAMS
    kv_bytes: int = 0
    adapter: str = ""  # the placement's adapter by name ("": none)
    adapter_dir: str = ""  # where this node holds its files ("": layers it does not adapt)
    # The plan's bytes of the adapter on this shard's layers: reported back, so that
    # memory promised to a shard still loading counts them (controller.committed_bytes).
    adapter_bytes: int = 0
    # Quantized KV (`place --kv-bits`): 0 full precision, else 8 or 4 bits in groups of
    # kv_group_size values (mlx-lm's QuantizedKVCache; shared.kv_quant says which layers).
    kv_bits: int = 0
    kv_group_size: int = 64
    # The prompt cache's budget on this shard, in memory and on its node's disk (the
    # plan counts the memory in the node's, like weights and KV).
    prompt_cache_bytes: int = 0
    prompt_cache_disk_bytes: int = 0
    # Speculative decoding (the head shard): "" none, "lookup" (prompt lookup) or
    # "model" (the draft model in `draft_dir`, loaded whole beside the head's layers),
    # with `draft_tokens` guesses per verify frame (0: the default).
    draft: str = ""
    draft_dir: str = ""
    draft_tokens: int = 0
    # The model's content digest that names the prefix cache's entries on disk ("": the
    # node's own files name them, worker.runner._files_key).
    model_digest: str = ""


class TensorMember(Wire, frozen=True, kw_only=True):
    """A tensor-parallel stage member's part of load_shard (no `group`: a one-node stage).
    The agent writes the hostfile (ring) or device file (jaccl) from it, worker.group."""

    group: list[str] = []  # the stage's nodes in rank order
    rank: int = 0
    backend: str = "ring"
    group_addresses: list[str] = []  # each member's bridge address, in rank order
    group_ports: list[int] = []  # each member's mx.distributed port
    devices: Any = None  # jaccl's device map
    followers: list[tuple[str, str]] = []  # the leader's: each follower's mirror endpoint, key
    leader_key: str = ""  # a follower's: its leader's CURVE key
    join_s: float = GROUP_JOIN_S  # how long the ranks wait for one another (GROUP_JOIN_S)


class Unload(Wire, frozen=True, kw_only=True):
    placement: str


class ReadLog(Wire, frozen=True, kw_only=True):
    lines: int = 200


class LinkPeer(Wire, frozen=True, kw_only=True):
    """A node another node measures its link to: its control endpoint and CURVE key."""

    name: str
    endpoint: str
    key: str


class LinkSizes(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How measure_links measures; a size not given is the agent's default. Each is
    checked against limits.LINK_MEASURE_BOUNDS, and an unknown one is refused."""

    pings: int | None = None
    pad_bytes: int | None = None
    bulk_seconds: float | None = None
    chunk_bytes: int | None = None
    in_flight: int | None = None


class MeasureLinks(Wire, frozen=True, kw_only=True):
    peers: list[LinkPeer]
    sizes: LinkSizes = LinkSizes()


class HubDownload(Wire, frozen=True, kw_only=True):
    repo: str
    revision: str
    files: list[str]
    cache_dir: str | None = None  # relative to the agent's home, else the hub's cache
    endpoint: str | None = None
    total: int = 0  # bytes the files take, checked against the free disk first


class DeviceBench(Wire, frozen=True, kw_only=True):
    # matmul_n, copy_mib, seconds, dtypes: given as they are to worker.device_bench,
    # which checks them (limits.DEVICE_BENCH_BOUNDS) and refuses bad ones in its words
    sizes: dict[str, Any]


# Model files (worker/files.py): `files` are the model's files by name, size and sha256.


class FilesStatus(Wire, frozen=True, kw_only=True):
    dirs: list[str]  # folders to look in, absolute or under the agent's home
    files: list[FileId]


class FilesCommit(Wire, frozen=True, kw_only=True):
    dir: str
    files: list[FileId]


class ServedFile(Wire, frozen=True, kw_only=True):
    name: str
    size: int


class ServeFiles(Wire, frozen=True, kw_only=True):
    dir: str
    files: list[ServedFile]


class FetchFiles(Wire, frozen=True, kw_only=True):
    dir: str
    files: list[FileId]
    endpoint: str  # the serving agent's file server
    key: str  # its CURVE public key
    token: str  # the grant serve_files answered


# Jobs (worker/jobs.py): one rank of a job per node, asked by studiotui.cluster.jobs.


class JobPorts(Wire, frozen=True, kw_only=True):
    count: int = 1  # free ports wanted (1-16, checked by the agent)


class StartJob(Wire, frozen=True, kw_only=True):
    job: str  # its name (checked by worker.jobs.check_name)
    job_kind: str
    rank: int
    size: int
    backend: str = "ring"
    hosts: list[tuple[str, int]] = []  # each rank's address and group port, in rank order
    devices: Any = None  # a jaccl group's device map, written as the rank's devices.json
    spec: dict[str, Any] = {}  # the job's own settings, passed to it as they are


class JobRef(Wire, frozen=True, kw_only=True):
    """stop_job, forget_job."""

    job: str


class FollowJob(JobRef, frozen=True, kw_only=True):
    since: int = 0  # the last event seen: only later ones are sent


class JobStatusAsk(Wire, frozen=True, kw_only=True):
    job: str = ""  # one job ("": all)


# ---- agent -> agent (link measurement) ------------------------------------------------


class Token(Wire, frozen=True, kw_only=True):
    """open_sink and close_sink (a link measurement), unserve_files (a file grant)."""

    token: str


class OpenSink(Token, frozen=True, kw_only=True):
    in_flight: int | None = None  # messages the measuring side keeps in flight


class SinkOpen(Wire, frozen=True, kw_only=True):
    port: int


class SinkResult(Wire, frozen=True, kw_only=True):
    bytes: int
    seconds: float
    messages: int


# ---- agent -> controller --------------------------------------------------------------


class ShardStats(Wire, frozen=True, kw_only=True):
    """A runner's counters, sent once a second (see worker.runner.Runner._stats)."""

    placement: str = ""
    busy: float = 0.0  # share of the last interval spent in steps
    in_flight: int = 0
    waiting: int = 0
    tokens: int = 0
    finished: int = 0
    dropped: int = 0
    errors: int = 0
    refused: int = 0
    prebuilt_steps: int = 0
    batched_steps: int = 0  # decode steps that ran several requests as one batch
    batched_rows: int = 0  # the requests those steps carried
    # (the head) speculative decoding's guesses sent in verify frames, and those kept
    drafted: int = 0
    kept: int = 0
    warm_ms: float = 0.0  # the stage's warm-up at load, before "ready" (worker.stage.warmup)
    active_bytes: int = 0
    # The prefix cache (worker.prompt_cache): this shard's entries and their bytes in
    # memory and on disk; on the head, the requests that reused an entry or found none
    # and the prompt tokens reused.
    prompt_cache_entries: int = 0
    prompt_cache_bytes: int = 0
    prompt_cache_disk_bytes: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    prompt_cache_reused: int = 0
    # The head's figures of its decode steps, medians in µs (worker.stage.RING_FIGURES):
    # a hop, a stage's Python per frame, the ring's overhead per token (hops and every
    # stage's Python), a token's time, and the MLX evaluation in it; None elsewhere.
    hop_us_p50: float | None = None
    frame_us_p50: float | None = None
    overhead_us_p50: float | None = None
    token_us_p50: float | None = None
    mlx_us_p50: float | None = None


class ShardReport(Wire, frozen=True, kw_only=True):
    """One shard as its agent describes it (hello_reply, shards, telemetry)."""

    placement: str
    model_dir: str = ""
    start: int = 0
    end: int = 0
    index: int = 0
    count: int = 0
    context_tokens: int = 0
    streams: int = 1
    kv_bytes: int = 0
    prefill_chunk: int = 512
    adapter: str = ""
    adapter_dir: str = ""
    adapter_bytes: int = 0  # the plan's share of the adapter on these layers
    draft: str = ""  # the head's speculative decoding ("", "lookup", "model")
    weight_bytes: int = 0  # the plan's weights for these layers (promised until loaded)
    kv_bits: int = 0  # quantized KV (0: full precision)
    kv_group_size: int = 64
    prompt_cache_bytes: int = 0  # the prompt cache's memory budget (promised while loaded)
    prompt_cache_disk_bytes: int = 0
    data_port: int = 0
    client_port: int = 0
    # A member of a tensor-parallel stage: its group port, rank, the group's nodes in
    # rank order and its mx.distributed backend ("" for a one-node stage).
    group_port: int = 0
    rank: int = 0
    group: list[str] = []
    backend: str = ""
    state: ShardStatus = "unknown"
    progress: tuple[int, int] = (0, 0)  # bytes loaded, of
    param_bytes: int = 0
    stats: ShardStats = ShardStats()
    message: str = ""
    pid: int | None = None
    silent_since: float | None = None  # wall clock


class NodeSample(Wire, frozen=True, kw_only=True):
    """What an agent says of its node in hello_reply and every telemetry message."""

    version: str = ""
    facts: dict[str, Any] = {}  # machine facts and probes, shown as they are
    shards: list[ShardReport] = []
    memory_total: int = 0
    memory_used: int = 0
    cpu_pct: float = 0.0
    gpu_pct: float | None = None
    # Power and memory pressure as the agent measured them: a source and figures, or
    # the reason there is none (worker.telemetry.Meter); shown as sent.
    power: dict[str, Any] = {}
    pressure: dict[str, Any] = {}


class AgentBrief(Wire, frozen=True, kw_only=True):
    """The part of hello_reply provisioning reads. It talks to agents of other builds
    too (the one it replaces), so it reads no more than this."""

    version: str = ""
    pid: int | None = None
    memory_total: int = 0


class HelloReply(NodeSample, frozen=True, kw_only=True):
    name: str
    pid: int
    address: str = ""
    control_port: int = 0
    started: float = 0.0


class Telemetry(NodeSample, frozen=True, kw_only=True):
    name: str
    time: float
    dropped: int = 0  # control messages the agent could not accept
    refused: int = 0  # control requests from a key that may not make them


class Prepared(Wire, frozen=True, kw_only=True):
    placement: str
    data_port: int
    client_port: int
    group_port: int = 0  # a tensor group member's port for mx.distributed (0: none)


class LoadProgress(Wire, frozen=True, kw_only=True):
    """A `progress` reply to load_shard: weight bytes read so far."""

    placement: str
    done: int
    total: int


class ShardReady(Wire, frozen=True, kw_only=True):
    placement: str
    start: int
    end: int
    param_bytes: int = 0


class Shards(Wire, frozen=True, kw_only=True):
    shards: list[ShardReport]


class LinkResult(Wire, frozen=True, kw_only=True):
    """One measured link, from the measuring node to `peer` (an `error` if it failed)."""

    peer: str
    kind: str = "unknown"
    latency_us: float | None = None  # median of the pings, one way
    latency_p90_us: float | None = None
    latency_pad_us: float | None = None  # with pings of pad_bytes (if asked)
    pad_bytes: int = 0
    gbps: float | None = None
    method: str = ""
    chunk_bytes: int = 0
    in_flight: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    seconds: float = 0.0  # the bulk stream's, at the receiver
    error: str = ""


class Links(Wire, frozen=True, kw_only=True):
    links: list[LinkResult]


class LogLines(Wire, frozen=True, kw_only=True):
    lines: list[str]


class FileStatus(Wire, frozen=True, kw_only=True):
    """One wanted file in one folder of a node."""

    name: str
    state: FileState
    size: int | None = None  # of the copy there, if any
    sha256: str | None = None
    partial: int = 0  # bytes of a part already landed, to resume from


class DirStatus(Wire, frozen=True, kw_only=True):
    dir: str = ""  # as asked
    path: str  # as resolved on the node
    free: int = 0  # bytes free on its disk
    files: list[FileStatus] = []

    def only(self, names: set[str]) -> DirStatus:
        return msgspec.structs.replace(self, files=[f for f in self.files if f.name in names])


class FilesFound(Wire, frozen=True, kw_only=True):
    """The `ok` answer to files_status: each folder asked, in order."""

    dirs: list[DirStatus]


class FileProgress(Wire, frozen=True, kw_only=True):
    stage: str  # hashing, copying, downloading
    done: int
    total: int


class Granted(Wire, frozen=True, kw_only=True):
    """The `ok` answer to serve_files: where and with which token to fetch."""

    port: int
    token: str


class Fetched(Wire, frozen=True, kw_only=True):
    """The `ok` answer to fetch_files."""

    path: str
    received: int
    resumed: int = 0


class Downloaded(Wire, frozen=True, kw_only=True):
    """The `ok` answer to hub_download."""

    path: str
    downloaded: int = 0


class JobPortsFree(Wire, frozen=True, kw_only=True):
    """The answer to job_ports."""

    ports: list[int]


class JobRank(Wire, frozen=True, kw_only=True):
    """One rank of a job as its agent describes it (job_started, job_stopped, jobs)."""

    job: str
    job_kind: str = ""
    rank: int = 0
    size: int = 1
    backend: str = ""
    state: str = ""  # starting, running, silent, done, failed, stopped
    message: str = ""
    code: int | None = None
    pid: int | None = None
    started: float = 0.0
    ended: float | None = None
    seq: int = 0
    latest: dict[str, Any] = {}  # the job's last event of each kind, as the job wrote it
    directory: str = ""
    spec: dict[str, Any] = {}


class JobsFound(Wire, frozen=True, kw_only=True):
    """The answer to job_status."""

    node: str = ""
    jobs: list[JobRank] = []


class JobEvent(Wire, frozen=True, kw_only=True):
    """One event of a followed rank; the job's own fields stay in `data`."""

    node: str = ""
    event: str
    seq: int
    data: dict[str, Any] = {}


class JobBeat(Wire, frozen=True, kw_only=True):
    """job_beat (the rank lives) and job_end (its last word)."""

    node: str = ""
    job: str = ""
    rank: int = 0
    state: str = ""
    message: str = ""
    code: int | None = None
    seq: int = 0


class BenchStep(Wire, frozen=True, kw_only=True):
    """A `bench_step` reply: the figure a benchmark starts on."""

    step: str = ""


class MatmulFigures(Wire, frozen=True, kw_only=True):
    n: int
    gflops: float


class MemoryFigures(Wire, frozen=True, kw_only=True):
    copy_gbs: float | None = None
    read_gbs: float | None = None


class DeviceFigures(Wire, frozen=True, kw_only=True):
    """What worker.device_bench measured (the `ok` answer to device_bench)."""

    device: str = ""  # which of the node's processors: "gpu" on a Mac, "cpu" here
    matmul: dict[str, MatmulFigures] = {}  # by dtype
    memory: MemoryFigures = MemoryFigures()
    # µs a decode step costs per layer by kind (dense, dense_q4, moe, moe_q4) and outside
    # its layers (step): worker.device_bench.decode_figures
    decode: dict[str, float] = {}


class DeviceBenchDone(Wire, frozen=True, kw_only=True):
    figures: DeviceFigures


class BenchStopped(Wire, frozen=True, kw_only=True):
    """The `ok` answer to stop_bench: how many measuring processes it ended."""

    stopped: int = 0
