"""Typed control messages: what an agent is asked, what it answers, what it publishes,
and what a head shard is asked and streams back.

Every message is a frozen msgspec struct tagged by its `type` (messages.Message);
`decode` reads a message's bytes once, straight into the one struct its tag names
(`AnyMessage`, their union), checking every field — optional ones too, and nested
ones (a shard report inside telemetry, a peer inside measure_links) — in C. A read
site never re-reads a `dict[str, Any]`: a handler takes its struct. A field of the
wrong type, or a status no one knows, raises `MessageError` naming the message, the
field and what was expected: the agent answers it with an error, the controller
counts it dropped.

Fields a message carries that a struct does not name are ignored (a newer peer may
send more).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, Union

import msgspec

from worker.shared.manifest import FileId
from worker.shared.protocol.limits import DEFAULT_STREAMS
from worker.shared.protocol.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    MessageError,
)
from worker.shared.protocol.status import FileState, ShardStatus

T = TypeVar("T")


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """A part of a message (a shard report, a peer, ...): fields a newer peer sends
    that a struct does not name are ignored."""


class Message(Wire, frozen=True, kw_only=True, tag_field="type"):
    """A whole control message: its tag is its `type` on the wire."""

    v: int = PROTOCOL_VERSION
    id: int | str | None = None  # a request's, echoed as `re` by every reply to it
    re: int | str | None = None

    @property
    def kind(self) -> str:
        """The message's type, as on the wire."""
        tag: str = self.__struct_config__.tag  # type: ignore[assignment]
        return tag


class Error(Message, frozen=True, kw_only=True, tag="error"):
    """A request refused or failed: `code` for programs, `message` for people."""

    message: str
    code: ErrorCode = "failed"


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    """A message's bytes on the wire."""
    return _encoder.encode(msg)


def parse(raw: Any, kind: type[T]) -> T:
    """`raw` (a plain map: a record kept on disk, a probe's facts, a part of one) as a
    `kind`, or MessageError. Messages from the network are read by `decode`."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        what = raw.get("type") if isinstance(raw, Mapping) else None
        raise MessageError(f"{what or kind.__name__}: {exc}") from None


def to_wire(struct: Wire) -> dict[str, Any]:
    """A struct's fields as a plain map (to keep on disk, to show)."""
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


class PrepareShard(Message, frozen=True, kw_only=True, tag="prepare_shard"):
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


class RenewShards(Message, frozen=True, kw_only=True, tag="renew_shards"):
    """The placing controller's "still copying": the leases of these placements'
    prepared shards start again (a shard loading or loaded has none)."""

    placements: list[str]


class Renewed(Message, frozen=True, kw_only=True, tag="renewed"):
    """The placements whose prepared shard here was renewed (others are not prepared
    here any more: loaded, unloaded, or dropped when their lease lapsed)."""

    placements: list[str]


class TensorMember(Message, frozen=True, kw_only=True):
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


class LoadShard(TensorMember, frozen=True, kw_only=True, tag="load_shard"):
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


class Hello(Message, frozen=True, kw_only=True, tag="hello"):
    """Who are you and what do you run (hello_reply); also the cheapest "are you there"."""


class ListShards(Message, frozen=True, kw_only=True, tag="list_shards"):
    """The shards this agent runs (shards)."""


class Shutdown(Message, frozen=True, kw_only=True, tag="shutdown"):
    """Stop the agent and every shard and job it runs (ok, then it exits)."""


class Unload(Message, frozen=True, kw_only=True, tag="unload"):
    placement: str


class Unloaded(Message, frozen=True, kw_only=True, tag="unloaded"):
    placement: str


class Ok(Message, frozen=True, kw_only=True, tag="ok"):
    """Done, nothing more to say (files_commit, shutdown)."""


class ReadLog(Message, frozen=True, kw_only=True, tag="read_log"):
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


class MeasureLinks(Message, frozen=True, kw_only=True, tag="measure_links"):
    peers: list[LinkPeer]
    sizes: LinkSizes = LinkSizes()


class HubDownload(Message, frozen=True, kw_only=True, tag="hub_download"):
    repo: str
    revision: str
    files: list[str]
    cache_dir: str | None = None  # relative to the agent's home, else the hub's cache
    endpoint: str | None = None
    total: int = 0  # bytes the files take, checked against the free disk first


class DeviceBench(Message, frozen=True, kw_only=True, tag="device_bench"):
    # matmul_n, copy_mib, seconds, dtypes: given as they are to worker.device_bench,
    # which checks them (limits.DEVICE_BENCH_BOUNDS) and refuses bad ones in its words
    sizes: dict[str, Any]


# Model files (worker/files.py): `files` are the model's files by name, size and sha256.


class FilesStatus(Message, frozen=True, kw_only=True, tag="files_status"):
    dirs: list[str]  # folders to look in, absolute or under the agent's home
    files: list[FileId]


class FilesCommit(Message, frozen=True, kw_only=True, tag="files_commit"):
    dir: str
    files: list[FileId]


class ServedFile(Wire, frozen=True, kw_only=True):
    name: str
    size: int


class ServeFiles(Message, frozen=True, kw_only=True, tag="serve_files"):
    dir: str
    files: list[ServedFile]


class FetchFiles(Message, frozen=True, kw_only=True, tag="fetch_files"):
    dir: str
    files: list[FileId]
    endpoint: str  # the serving agent's file server
    key: str  # its CURVE public key
    token: str  # the grant serve_files answered


# Jobs (worker/jobs.py): one rank of a job per node, asked by studiotui.cluster.jobs.


class JobPorts(Message, frozen=True, kw_only=True, tag="job_ports"):
    count: int = 1  # free ports wanted (1-16, checked by the agent)


class StartJob(Message, frozen=True, kw_only=True, tag="start_job"):
    job: str  # its name (checked by worker.jobs.check_name)
    job_kind: str
    rank: int
    size: int
    backend: str = "ring"
    hosts: list[tuple[str, int]] = []  # each rank's address and group port, in rank order
    devices: Any = None  # a jaccl group's device map, written as the rank's devices.json
    spec: dict[str, Any] = {}  # the job's own settings, passed to it as they are


class JobRef(Message, frozen=True, kw_only=True):
    """A request naming one job."""

    job: str


class StopJob(JobRef, frozen=True, kw_only=True, tag="stop_job"):
    pass


class ForgetJob(JobRef, frozen=True, kw_only=True, tag="forget_job"):
    """Forget a finished job here (forgotten says whether it was)."""


class Forgotten(Message, frozen=True, kw_only=True, tag="forgotten"):
    forgotten: bool


class FollowJob(JobRef, frozen=True, kw_only=True, tag="follow_job"):
    since: int = 0  # the last event seen: only later ones are sent


class JobStatusAsk(Message, frozen=True, kw_only=True, tag="job_status"):
    job: str = ""  # one job ("": all)


# ---- agent -> agent (link measurement) ------------------------------------------------


class Token(Message, frozen=True, kw_only=True):
    """A request naming a link sink (open_sink, close_sink) or a file grant."""

    token: str


class OpenSink(Token, frozen=True, kw_only=True, tag="open_sink"):
    in_flight: int | None = None  # messages the measuring side keeps in flight


class CloseSink(Token, frozen=True, kw_only=True, tag="close_sink"):
    """The measured stream ended: what the sink received (sink_result)."""


class UnserveFiles(Token, frozen=True, kw_only=True, tag="unserve_files"):
    """End a file grant (unserved: the bytes it sent)."""


class Unserved(Message, frozen=True, kw_only=True, tag="unserved"):
    sent: int = 0


class PingPeer(Message, frozen=True, kw_only=True, tag="ping_peer"):
    """A link measurement's ping; with `echo`, its `pad` comes back whole (pong)."""

    pad: bytes = b""
    echo: bool = False


class Pong(Message, frozen=True, kw_only=True, tag="pong"):
    pad: bytes = b""


class SinkOpen(Message, frozen=True, kw_only=True, tag="sink_open"):
    port: int


class SinkResult(Message, frozen=True, kw_only=True, tag="sink_result"):
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
    # (the head) verify steps it computed while the one before was out and then sent
    # (worker.stage.verify: every guess kept, as guessed)
    verified_ahead: int = 0
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


class StatsReply(Message, frozen=True, kw_only=True, tag="stats_reply"):
    """A head shard's answer to `stats`."""

    stats: ShardStats


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
    # The model's content digest its load was given: a restart loads it again with it,
    # so the prefix cache's entries on disk keep their name (LoadShard.model_digest).
    model_digest: str = ""
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


class AgentBrief(Message, frozen=True, kw_only=True):
    """What provisioning reads of a hello_reply: its version, pid and memory."""

    version: str = ""
    pid: int | None = None
    memory_total: int = 0


class NodeSample(AgentBrief, frozen=True, kw_only=True):
    """What an agent says of its node in hello_reply and every telemetry message."""

    facts: dict[str, Any] = {}  # machine facts and probes, shown as they are
    shards: list[ShardReport] = []
    memory_used: int = 0
    cpu_pct: float = 0.0
    gpu_pct: float | None = None
    # Power and memory pressure as the agent measured them: a source and figures, or
    # the reason there is none (worker.telemetry.Meter); shown as sent.
    power: dict[str, Any] = {}
    pressure: dict[str, Any] = {}
    # Bytes free on the disk of the agent's home (its workdir), where shards keep their
    # prefix cache's entries; None from an agent that does not say.
    disk_free: int | None = None


class HelloReply(NodeSample, frozen=True, kw_only=True, tag="hello_reply"):
    name: str
    pid: int
    address: str = ""
    control_port: int = 0
    started: float = 0.0


class Telemetry(NodeSample, frozen=True, kw_only=True, tag="telemetry"):
    name: str
    time: float
    dropped: int = 0  # control messages the agent could not accept
    refused: int = 0  # control requests from a key that may not make them


class Prepared(Message, frozen=True, kw_only=True, tag="prepared"):
    placement: str
    data_port: int
    client_port: int
    group_port: int = 0  # a tensor group member's port for mx.distributed (0: none)


class LoadProgress(Message, frozen=True, kw_only=True, tag="progress"):
    """A `progress` reply to load_shard: weight bytes read so far."""

    placement: str
    done: int
    total: int


class ShardReady(Message, frozen=True, kw_only=True, tag="shard_ready"):
    placement: str
    start: int
    end: int
    param_bytes: int = 0


class Shards(Message, frozen=True, kw_only=True, tag="shards"):
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


class Links(Message, frozen=True, kw_only=True, tag="links"):
    links: list[LinkResult]


class LogLines(Message, frozen=True, kw_only=True, tag="log"):
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


class FilesFound(Message, frozen=True, kw_only=True, tag="files_found"):
    """The answer to files_status: each folder asked, in order."""

    dirs: list[DirStatus]


class FileProgress(Message, frozen=True, kw_only=True, tag="file_progress"):
    stage: str  # hashing, copying, downloading
    done: int
    total: int


class Granted(Message, frozen=True, kw_only=True, tag="granted"):
    """The answer to serve_files: where and with which token to fetch."""

    port: int
    token: str


class Fetched(Message, frozen=True, kw_only=True, tag="fetched"):
    """The answer to fetch_files."""

    path: str
    received: int
    resumed: int = 0


class Downloaded(Message, frozen=True, kw_only=True, tag="downloaded"):
    """The answer to hub_download."""

    path: str
    downloaded: int = 0


class JobPortsFree(Message, frozen=True, kw_only=True, tag="job_ports_free"):
    """The answer to job_ports."""

    ports: list[int]


class JobRank(Message, frozen=True, kw_only=True, tag="job_rank"):
    """One rank of a job as its agent describes it (in jobs; job_started and job_stopped
    are one too)."""

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


class JobStarted(JobRank, frozen=True, kw_only=True, tag="job_started"):
    pass


class JobStopped(JobRank, frozen=True, kw_only=True, tag="job_stopped"):
    pass


class JobsFound(Message, frozen=True, kw_only=True, tag="jobs"):
    """The answer to job_status."""

    node: str = ""
    jobs: list[JobRank] = []


class JobEvent(Message, frozen=True, kw_only=True, tag="job_event"):
    """One event of a followed rank; the job's own fields stay in `data`."""

    node: str = ""
    event: str
    seq: int
    data: dict[str, Any] = {}


class JobBeat(Message, frozen=True, kw_only=True, tag="job_beat"):
    """job_beat (the rank lives) and job_end (its last word)."""

    node: str = ""
    job: str = ""
    rank: int = 0
    state: str = ""
    message: str = ""
    code: int | None = None
    seq: int = 0


class JobEnd(JobBeat, frozen=True, kw_only=True, tag="job_end"):
    pass


class StopBench(Message, frozen=True, kw_only=True, tag="stop_bench"):
    """The measurement asked for was given up: end its process now (bench_stopped)."""


class BenchStep(Message, frozen=True, kw_only=True, tag="bench_step"):
    """A `bench_step` reply: the figure a benchmark starts on."""

    step: str = ""


class MatmulFigures(Wire, frozen=True, kw_only=True):
    n: int
    gflops: float


class MemoryFigures(Wire, frozen=True, kw_only=True):
    copy_gbs: float | None = None
    read_gbs: float | None = None


class DeviceFigures(Wire, frozen=True, kw_only=True):
    """What worker.device_bench measured (in bench_done, the answer to device_bench)."""

    device: str = ""  # which of the node's processors: "gpu" on a Mac, "cpu" here
    matmul: dict[str, MatmulFigures] = {}  # by dtype
    memory: MemoryFigures = MemoryFigures()
    # µs a decode step costs per layer by kind (dense, dense_tp2, dense_q4, moe, moe_q4)
    # and outside its layers (step): worker.device_bench.decode_figures
    decode: dict[str, float] = {}


class DeviceBenchDone(Message, frozen=True, kw_only=True, tag="bench_done"):
    figures: DeviceFigures


class BenchStopped(Message, frozen=True, kw_only=True, tag="bench_stopped"):
    """The answer to stop_bench: how many measuring processes it ended."""

    stopped: int = 0


# ---- agent -> agent (a model's files, worker/files.py) ----------------------------------


class ReadChunk(Message, frozen=True, kw_only=True, tag="read"):
    """Up to `length` bytes of a served file from `offset` (chunk, with the bytes as the
    message's second frame)."""

    token: str
    name: str
    offset: int
    length: int
    seq: int = 0


class Chunk(Message, frozen=True, kw_only=True, tag="chunk"):
    offset: int
    seq: int = 0


# ---- controller -> head shard (worker/runner.py, worker/stage.py) ------------------------


class Generate(Message, frozen=True, kw_only=True, tag="generate"):
    """A request to answer: `params` the sampling (worker.sampling.SamplingParams) and
    one of messages, prompt or tokens. The head shard checks each of them and refuses
    a bad one in its own words (a `failed` with code bad_request), so they are taken
    here as they come."""

    rid: str
    params: dict[str, Any]
    messages: Any = None
    prompt: Any = None
    tokens: Any = None
    tools: Any = None
    draft: Any = None  # the request's guesser ("lookup", "model", ""); None: the placement's
    prediction: Any = None  # a predicted answer: text or token ids


class Cancel(Message, frozen=True, kw_only=True, tag="cancel"):
    rid: str


class StatsAsk(Message, frozen=True, kw_only=True, tag="stats"):
    """The head shard's counters (stats_reply)."""


class CacheClear(Message, frozen=True, kw_only=True, tag="cache_clear"):
    """Empty the placement's prefix cache, every stage (cache_cleared)."""


class CacheCleared(Message, frozen=True, kw_only=True, tag="cache_cleared"):
    """What the head's prefix cache held: entries and bytes."""

    entries: int = 0
    bytes: int = 0


# ---- head shard -> controller: one request's stream ---------------------------------------


class Streamed(Message, frozen=True, kw_only=True):
    """A message of one request's answer: numbered, so a gap (messages lost while the
    connection was down) is seen."""

    rid: str
    seq: int | None = None


class Accepted(Streamed, frozen=True, kw_only=True, tag="accepted"):
    prompt_tokens: int
    cached_tokens: int = 0  # of them, reused from the prefix cache


class Delta(Streamed, frozen=True, kw_only=True, tag="delta"):
    text: str
    tokens: list[int]
    logprobs: list[dict[str, Any]] | None = None  # each token's, if the request asked
    tool_calls: list[dict[str, Any]] | None = None


class Done(Streamed, frozen=True, kw_only=True, tag="done"):
    finish_reason: str
    usage: dict[str, Any]
    timings: dict[str, Any] = {}
    stop: str = ""  # the stop string that ended the answer, if one did


class Failed(Streamed, frozen=True, kw_only=True, tag="failed"):
    """The request failed: refused before it was accepted (`code` says why: bad_request,
    busy, ...) or after (failed)."""

    message: str
    code: ErrorCode = "failed"
    group_lost: list[str] = []  # a tensor group whose link broke: its nodes
    # The request's field a bad_request refusal blames (tools, response_format, draft,
    # prediction, a sampling parameter), for the API's error `param`; None: no one field.
    param: str | None = None


# One request's answer as the controller's `generate` yields it to its readers (the
# chat, the API's shapes, the CLI): the messages as decoded, read with `match`. A
# `failed` is raised (GenerationError), never yielded.
Answer = Accepted | Delta | Done


# ---- the union, and reading a message off the wire -----------------------------------------

AnyMessage = Union[  # noqa: UP007 (msgspec reads the union from this object)
    Hello,
    PrepareShard,
    RenewShards,
    LoadShard,
    Unload,
    ListShards,
    MeasureLinks,
    PingPeer,
    OpenSink,
    CloseSink,
    Shutdown,
    ReadLog,
    FilesStatus,
    FilesCommit,
    ServeFiles,
    UnserveFiles,
    FetchFiles,
    HubDownload,
    ReadChunk,
    DeviceBench,
    StopBench,
    JobPorts,
    StartJob,
    FollowJob,
    JobStatusAsk,
    StopJob,
    ForgetJob,
    HelloReply,
    Telemetry,
    Prepared,
    Renewed,
    LoadProgress,
    ShardReady,
    Unloaded,
    Shards,
    Links,
    LogLines,
    Ok,
    Error,
    Pong,
    SinkOpen,
    SinkResult,
    FilesFound,
    FileProgress,
    Granted,
    Unserved,
    Fetched,
    Downloaded,
    Chunk,
    BenchStep,
    DeviceBenchDone,
    BenchStopped,
    JobPortsFree,
    JobStarted,
    JobStopped,
    JobsFound,
    JobEvent,
    JobBeat,
    JobEnd,
    Forgotten,
    Generate,
    Cancel,
    StatsAsk,
    CacheClear,
    StatsReply,
    CacheCleared,
    Accepted,
    Delta,
    Done,
    Failed,
]
# Each message's struct by its type (what `build` makes from a type's name).
BY_KIND: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls
    for cls in AnyMessage.__args__  # type: ignore[attr-defined]
}
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def build(kind: str, **fields: Any) -> Message:
    """The message of type `kind` with these fields, checked as its reader checks it
    (nested maps become their structs): for senders that name a message by its type
    (a Stage's `to_client`, the controller's `Peer.send`). MessageError if one is wrong."""
    try:
        return msgspec.convert(fields, BY_KIND[kind])
    except KeyError:
        raise MessageError(f"unknown message type {kind!r}") from None
    except msgspec.ValidationError as exc:
        raise MessageError(f"{kind}: {exc}") from None


def decode(data: bytes) -> AnyMessage:
    """A message's bytes as its struct, every field checked; or MessageError saying
    what is wrong (with `re` set when the message carried an id to answer)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES} limit")
    try:
        msg: AnyMessage = _decoder.decode(data)
    except msgspec.DecodeError:  # ValidationError is one too: name the fault, slowly
        raise _fault(data) from None
    if msg.v != PROTOCOL_VERSION:
        raise _version_fault(msg.v, msg.id)
    return msg


def _fault(data: bytes) -> MessageError:
    """Why `data` is no message: decoded as plain msgpack, the envelope checked first
    (a peer of another version is told so, not that a field is wrong)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        return MessageError(f"not a msgpack message: {exc}")
    if not isinstance(raw, dict):
        return MessageError(f"expected a map, got {type(raw).__name__}")
    rid = raw.get("id")
    if raw.get("v") != PROTOCOL_VERSION:
        return _version_fault(raw.get("v"), rid)
    kind = raw.get("type")
    if kind not in BY_KIND:
        error = MessageError(f"unknown message type {kind!r}")
    else:
        try:
            msgspec.convert(raw, BY_KIND[kind])
        except msgspec.ValidationError as exc:
            error = MessageError(f"{kind}: {exc}")
        else:  # a map key msgpack allows and a struct's field names do not (an int)
            error = MessageError(f"{kind}: a map key that is not a string")
    if isinstance(rid, int | str) and not isinstance(rid, bool):
        error.re = rid
    return error


def _version_fault(version: Any, rid: Any) -> MessageError:
    error = MessageError(
        f"protocol version {version!r} is not {PROTOCOL_VERSION}; "
        "run the same studiotui version on both sides (provision --upgrade)"
    )
    if isinstance(rid, int | str) and not isinstance(rid, bool):
        error.re = rid
    return error
