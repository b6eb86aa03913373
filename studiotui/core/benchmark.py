"""The cluster benchmark's figures: what one run measured, the arithmetic on them, and the
runs saved under STUDIOTUI_HOME/benchmarks/ to compare.

A run holds, per node, MLX matrix-multiply GFLOP/s per dtype and memory GB/s (measured by
the node's agent on its own device); per link, latency and bandwidth on CURVE ZeroMQ
sockets; for the group, a distributed product over `mx.distributed` against the sum of
its nodes' own figures; per placement, decode tok/s and time to first token over
concurrent streams. Everything here is pure but the small file store at the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studiotui.core.errors import StudioError
from worker.shared.protocol.limits import (
    DEVICE_BENCH_BOUNDS,
    GROUP_BENCH_BOUNDS,
    LINK_MEASURE_BOUNDS,
    out_of_bounds,
)

FORMAT = 1
DTYPES = ("float32", "bfloat16", "float16")
STREAM_COUNTS = (1, 2, 4, 8)
BENCHMARKS_DIR = "benchmarks"
# What the operator's own steps take at most. Each point of stream_counts decodes
# count x stream_tokens tokens after a prompt_tokens prefill per stream: a typo
# (stream_tokens=64000, stream_counts=1,2,4,800) would ask for hours of decoding.
RUN_BOUNDS: dict[str, tuple[float, float]] = {
    "group_reps": GROUP_BENCH_BOUNDS["reps"],
    "stream_tokens": (1, 4096),
    "prompt_tokens": (1, 32768),
}
MAX_STREAM_COUNT = 64  # streams at once in one point
MAX_STREAM_POINTS = 16  # points in stream_counts


class BenchmarkError(StudioError, RuntimeError):
    """A benchmark that cannot run as asked, or a saved run that cannot be read."""


# ---- what to measure, and how much ----------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How long and how large each measurement is. The defaults take a second or two a
    figure on a small machine; tests ask for tiny ones."""

    matmul_n: int = 4096  # the largest square product tried; each dtype is sized to time
    copy_mib: int = 256  # the array copied and read for memory bandwidth
    seconds: float = 0.4  # per device figure, after a warm-up
    link_seconds: float = 1.0  # of bulk streaming per direction of a link
    link_chunk_bytes: int = 4 << 20  # one message of the bulk stream
    link_in_flight: int = 4  # messages queued while one is on the wire
    link_pings: int = 51
    link_pad_bytes: int = 16 << 10  # a ping the size of a decode step's activation
    group_reps: int = 5  # timed steps of the distributed product
    stream_counts: tuple[int, ...] = STREAM_COUNTS
    stream_tokens: int = 64  # decoded per stream
    prompt_tokens: int = 128

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            matmul_n=1024,
            copy_mib=64,
            seconds=0.2,
            link_seconds=0.3,
            link_pings=21,
            group_reps=3,
            stream_tokens=24,
            prompt_tokens=32,
        )

    def changed(self, overrides: Sequence[str]) -> Sizes:
        """These sizes with `NAME=VALUE` overrides (`--size matmul_n=512`); a name that is
        not a size, a value of the wrong kind or one out of its bounds is refused, naming
        it."""
        known = {f.name: f for f in fields(self)}
        values: dict[str, Any] = {}
        for item in overrides:
            name, sep, text = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in known:
                raise BenchmarkError(
                    f"--size {item!r} is not NAME=VALUE with a known name",
                    f"sizes: {', '.join(known)}",
                )
            current = getattr(self, name)
            try:
                if isinstance(current, tuple):
                    value: Any = tuple(_number(int, x) for x in text.split(",") if x.strip())
                    if not value or min(value) < 1:
                        raise ValueError("wants whole numbers of at least 1")
                else:
                    value = _number(type(current), text)
                    if (value <= 0 and name != "link_pad_bytes") or value < 0:
                        raise ValueError("wants a positive number")
            except ValueError as exc:
                raise BenchmarkError(f"--size {name}={text!r}: {exc}") from None
            values[name] = value
        changed = replace(self, **values)
        changed.check("--size")
        return changed

    def check(self, where: str) -> None:
        """Refuse sizes out of their bounds, before anything is measured: the message
        names the size and its bounds, the hint its default."""
        name, problem = self._problem()
        if problem:
            default = getattr(Sizes(), name)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            raise BenchmarkError(
                f"{where}: {problem}", f"give {name} a value within them (the default is {shown})"
            )

    def problem(self) -> str:
        """What is out of bounds in these sizes, in words ("" if nothing), naming each
        size as `--size` does (`link_seconds`, not the agent's `bulk_seconds`)."""
        return self._problem()[1]

    def _problem(self) -> tuple[str, str]:
        """The first size out of bounds and why, or ("", "")."""
        checks = (
            (self.device_spec(), DEVICE_BENCH_BOUNDS),
            (
                {size: getattr(self, size) for size in LINK_FIELDS},
                {size: LINK_MEASURE_BOUNDS[wire] for size, wire in LINK_FIELDS.items()},
            ),
            ({size: getattr(self, size) for size in RUN_BOUNDS}, RUN_BOUNDS),
        )
        for values, bounds in checks:
            for name, value in values.items():
                problem = out_of_bounds({name: value}, bounds)
                if problem:
                    return name, problem
        counts = self.stream_counts
        if len(counts) > MAX_STREAM_POINTS:
            return "stream_counts", (
                f"stream_counts may list at most {MAX_STREAM_POINTS} counts, not {len(counts)}"
            )
        wrong = [k for k in counts if not 1 <= k <= MAX_STREAM_COUNT]
        if wrong:
            return "stream_counts", (
                f"stream_counts must each be between 1 and {MAX_STREAM_COUNT}, not {wrong[0]}"
            )
        return "", ""

    def device_spec(self) -> dict[str, Any]:
        """What an agent's `device_bench` request carries."""
        return {"matmul_n": self.matmul_n, "copy_mib": self.copy_mib, "seconds": self.seconds}

    def link_spec(self) -> dict[str, Any]:
        """What an agent's `measure_links` request carries."""
        return {wire: getattr(self, size) for size, wire in LINK_FIELDS.items()}


# Each link size's name in `Sizes` (and `--size`) and the one `measure_links` takes.
LINK_FIELDS = {
    "link_pings": "pings",
    "link_pad_bytes": "pad_bytes",
    "link_seconds": "bulk_seconds",
    "link_chunk_bytes": "chunk_bytes",
    "link_in_flight": "in_flight",
}


def _number(kind: type, text: str) -> Any:
    """`text` as an int or a float, or a ValueError in the user's words (not Python's
    "invalid literal for int() with base 10")."""
    try:
        return kind(text.strip())
    except ValueError:
        raise ValueError("wants a whole number" if kind is int else "wants a number") from None


# ---- the figures ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeFigures:
    name: str
    chip: str = ""
    device: str = ""
    gflops: dict[str, float] = field(default_factory=dict)  # per dtype
    matmul_n: dict[str, int] = field(default_factory=dict)  # the product each was timed on
    copy_gbs: float | None = None  # read and write of every byte
    read_gbs: float | None = None  # a sum: read only
    # µs of a decode step per layer by kind (dense, dense_tp2, dense_q4, moe, moe_q4) and
    # outside its layers (step): what the forecast prices a stage with (worker/device_bench.py)
    decode_us: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class LinkFigures:
    """Both directions of a pair, each measured by its sending end."""

    a: str
    b: str
    kind: str = "unknown"
    latency_us: float | None = None  # one way, median of small pings, best direction
    latency_pad_us: float | None = None  # the same with an activation-sized message
    gbps: float | None = None  # a -> b
    gbps_back: float | None = None  # b -> a
    error: str = ""

    @property
    def best_gbps(self) -> float | None:
        found = [g for g in (self.gbps, self.gbps_back) if g is not None]
        return max(found) if found else None


@dataclass(frozen=True)
class GroupFigures:
    """C = A @ B (n x n, float32) with the inner dimension split over the nodes and the
    partial products summed by `mx.distributed.all_sum`."""

    nodes: tuple[str, ...] = ()
    backend: str = ""
    n: int = 0
    gflops: float | None = None  # together, the sum included
    parts_gflops: float | None = None  # the nodes' own float32 figures, added up
    compute_s: float | None = None  # the slowest rank's own share, without the sum
    step_s: float | None = None  # one whole step, the sum included
    max_error: float | None = None  # against the product made whole on rank 0
    launcher: str = ""
    error: str = ""
    allreduce_us: float | None = None  # one all-reduce of a decode step's activation

    @property
    def efficiency(self) -> float | None:
        return scaling(self.gflops, self.parts_gflops)


@dataclass(frozen=True)
class StreamPoint:
    streams: int
    tps: float  # tokens of all streams over the wall time
    ttft_ms: float  # median over the streams, queueing included
    tokens: int

    @property
    def decode_tps(self) -> float:
        """Tokens a second after the first (one stream: its decode alone, what the
        forecast's tok/s is of); the whole rate where the split cannot be made."""
        if self.streams != 1 or self.tps <= 0 or self.tokens < 2:
            return self.tps
        after = self.tokens / self.tps - self.ttft_ms / 1e3
        return (self.tokens - 1) / after if after > 0 else self.tps


@dataclass(frozen=True)
class PlacementFigures:
    name: str
    model: str = ""
    nodes: tuple[str, ...] = ()
    admitted: int = 0  # streams the placement serves at once; more wait in its queue
    points: tuple[StreamPoint, ...] = ()
    error: str = ""
    shape: str = ""  # "2 stages", "1 stage × 2 (ring)": what the preview's forecast is of


@dataclass(frozen=True)
class Run:
    id: str
    date: str  # ISO 8601, UTC
    cluster: str
    machine: dict[str, str]
    build: str
    sizes: Sizes
    nodes: tuple[NodeFigures, ...] = ()
    links: tuple[LinkFigures, ...] = ()
    group: GroupFigures | None = None
    placements: tuple[PlacementFigures, ...] = ()
    seconds: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def errors(self) -> list[str]:
        found = [f"{n.name}: {n.error}" for n in self.nodes if n.error]
        found += [f"{x.a} ↔ {x.b}: {x.error}" for x in self.links if x.error]
        if self.group is not None and self.group.error:
            found.append(f"group: {self.group.error}")
        found += [f"{p.name}: {p.error}" for p in self.placements if p.error]
        return found

    @property
    def label(self) -> str:
        return f"{self.id} · {self.cluster} · {self.build}"


# ---- the steps of a run -------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Where a run is: step `index` (from 1) of `total`, and what a node says it is at."""

    index: int
    total: int
    label: str
    detail: str = ""
    state: str = "running"  # running, done, failed

    @property
    def fraction(self) -> float:
        done = self.index - (self.state == "running")
        return done / self.total if self.total else 1.0


def plan_steps(
    nodes: Sequence[str], placements: Sequence[str], stream_counts: Sequence[int]
) -> list[str]:
    """Every step of a run in order: each node's device, each direction of each link, the
    group's product (two nodes or more), each placement at each stream count."""
    steps = [f"{n}: device" for n in nodes]
    steps += [f"link {a} → {b}" for a in nodes for b in nodes if a != b]
    if len(nodes) >= 2:
        steps.append(f"group of {len(nodes)}: distributed product")
    steps += [f"{p}: {k} stream{'s' if k != 1 else ''}" for p in placements for k in stream_counts]
    return steps


# ---- arithmetic -------------------------------------------------------------------------


def scaling(together: float | None, parts: float | None) -> float | None:
    """What a group reaches against the sum of its parts (1.0: nothing lost)."""
    if together is None or not parts:
        return None
    return together / parts


def parts_gflops(nodes: Iterable[NodeFigures], names: Sequence[str], dtype: str) -> float | None:
    """The named nodes' own GFLOP/s in `dtype`, added up; None if one lacks the figure."""
    by_name = {n.name: n for n in nodes}
    found = [by_name[n].gflops.get(dtype) if n in by_name else None for n in names]
    if not found or any(f is None for f in found):
        return None
    return sum(f for f in found if f is not None)


def group_n(nodes: Iterable[NodeFigures], names: Sequence[str], cap: int) -> int:
    """The distributed product's size: the smallest float32 product the nodes were timed
    on (so the sum of parts is figures at that size), a multiple of the group's size."""
    by_name = {n.name: n for n in nodes}
    sizes = [by_name[n].matmul_n.get("float32", cap) for n in names if n in by_name]
    n = min([cap, *sizes])
    ranks = max(1, len(names))
    return max(ranks, n - n % ranks)


def merge_directions(
    a: str, b: str, results: Sequence[Mapping[str, Any]], kind: str
) -> LinkFigures:
    """One pair's figures from what each end measured (`measure_links` results, each with
    the measuring node as `from`): latency the best of both, bandwidth per direction."""
    good = [r for r in results if "latency_us" in r]
    errors = [str(r["error"]) for r in results if r.get("error")]
    if not good:
        return LinkFigures(a, b, kind, error="; ".join(errors) or "no measurement")

    def figure(key: str, rows: Iterable[Mapping[str, Any]]) -> float | None:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        return min(values) if key.startswith("latency") else (max(values) if values else None)

    forward = [r for r in good if r.get("from") == a]
    backward = [r for r in good if r.get("from") == b]
    return LinkFigures(
        a,
        b,
        kind,
        latency_us=figure("latency_us", good),
        latency_pad_us=figure("latency_pad_us", good)
        if any("latency_pad_us" in r for r in good)
        else None,
        gbps=figure("gbps", forward),
        gbps_back=figure("gbps", backward),
        error="; ".join(errors),
    )


def stream_point(streams: int, runs: Sequence[Mapping[str, Any]]) -> StreamPoint:
    """Concurrent streams' figures: every token over the wall time from the first start
    to the last token, and the median time to a first token."""
    if not runs:
        raise ValueError("no stream ran")
    tokens = sum(len(r["tokens"]) for r in runs)
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    ttfts = sorted(float(r["ttft_ms"]) for r in runs)
    middle = len(ttfts) // 2
    ttft = ttfts[middle] if len(ttfts) % 2 else (ttfts[middle - 1] + ttfts[middle]) / 2
    return StreamPoint(streams, tokens / wall if wall > 0 else 0.0, ttft, tokens)


def finite_figures(run: Run) -> list[float]:
    """Every measured number of a run (for checks that none is NaN or infinite)."""
    values: list[float] = []
    for n in run.nodes:
        values += list(n.gflops.values()) + [v for v in (n.copy_gbs, n.read_gbs) if v is not None]
    for x in run.links:
        values += [
            v for v in (x.latency_us, x.latency_pad_us, x.gbps, x.gbps_back) if v is not None
        ]
    if run.group is not None:
        g = run.group
        values += [v for v in (g.gflops, g.parts_gflops, g.step_s, g.compute_s) if v is not None]
    for p in run.placements:
        values += [v for point in p.points for v in (point.tps, point.ttft_ms)]
    return values


# ---- comparing two runs -----------------------------------------------------------------


@dataclass(frozen=True)
class CompareRow:
    section: str  # node, link, group, placement
    item: str  # the node, the pair, the placement
    figure: str
    unit: str
    a: float | None
    b: float | None
    higher_is_better: bool = True

    @property
    def change(self) -> float | None:
        """b against a (+0.10: b is 10 % higher)."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a - 1.0


def figure_rows(run: Run) -> list[CompareRow]:
    """A run's figures as rows (b left empty): what compare lines up."""
    rows: list[CompareRow] = []
    for n in run.nodes:
        for dtype in DTYPES:
            rows.append(
                CompareRow("node", n.name, f"matmul {dtype}", "GFLOP/s", n.gflops.get(dtype), None)
            )
        rows.append(CompareRow("node", n.name, "memory copy", "GB/s", n.copy_gbs, None))
        rows.append(CompareRow("node", n.name, "memory read", "GB/s", n.read_gbs, None))
    for x in run.links:
        pair = f"{x.a} ↔ {x.b}"
        rows.append(CompareRow("link", pair, "latency", "µs", x.latency_us, None, False))
        rows.append(
            CompareRow("link", pair, "latency, activation", "µs", x.latency_pad_us, None, False)
        )
        rows.append(CompareRow("link", pair, f"{x.a} → {x.b}", "Gbit/s", x.gbps, None))
        rows.append(CompareRow("link", pair, f"{x.b} → {x.a}", "Gbit/s", x.gbps_back, None))
    if run.group is not None:
        g, item = run.group, ", ".join(run.group.nodes)
        rows.append(CompareRow("group", item, "together", "GFLOP/s", g.gflops, None))
        rows.append(CompareRow("group", item, "sum of parts", "GFLOP/s", g.parts_gflops, None))
        rows.append(CompareRow("group", item, "scaling", "×", g.efficiency, None))
    for p in run.placements:
        for point in p.points:
            s = f"{point.streams} stream{'s' if point.streams != 1 else ''}"
            rows.append(CompareRow("placement", p.name, f"{s} decode", "tok/s", point.tps, None))
            rows.append(
                CompareRow(
                    "placement", p.name, f"{s} first token", "ms", point.ttft_ms, None, False
                )
            )
    return rows


def compare(a: Run, b: Run) -> list[CompareRow]:
    """Every figure of either run side by side, in a's order then b's new ones."""
    rows: dict[tuple[str, str, str], CompareRow] = {}
    for row in figure_rows(a):
        rows[(row.section, row.item, row.figure)] = row
    for row in figure_rows(b):
        key = (row.section, row.item, row.figure)
        if key in rows:
            rows[key] = replace(rows[key], b=row.a)
        else:
            rows[key] = replace(row, a=None, b=row.a)
    return [r for r in rows.values() if r.a is not None or r.b is not None]


# ---- saving and reading -----------------------------------------------------------------


def new_id(when: datetime, cluster: str) -> str:
    """A run's id and file name: its UTC time, then the cluster (sorts by time)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", cluster) or "cluster"
    return f"{when.astimezone(UTC):%Y%m%d-%H%M%S}-{safe}"


def iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def to_json(run: Run) -> dict[str, Any]:
    return {"format": FORMAT, **asdict(run)}


def _build(cls: Any, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise TypeError(f"{cls.__name__} is not an object")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in names})


def from_json(raw: Any) -> Run:
    """A run from its saved JSON; a file from another format or damaged raises
    BenchmarkError."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise BenchmarkError(f"not a benchmark run of format {FORMAT} (format {got!r})")
    try:
        sizes = _build(Sizes, raw["sizes"])
        sizes = replace(sizes, stream_counts=tuple(sizes.stream_counts))
        nodes = tuple(_build(NodeFigures, n) for n in raw.get("nodes", []))
        links = tuple(_build(LinkFigures, x) for x in raw.get("links", []))
        group = raw.get("group")
        placements = tuple(
            replace(
                _build(PlacementFigures, p),
                nodes=tuple(p.get("nodes", ())),
                points=tuple(_build(StreamPoint, q) for q in p.get("points", [])),
            )
            for p in raw.get("placements", [])
        )
        return Run(
            id=str(raw["id"]),
            date=str(raw["date"]),
            cluster=str(raw["cluster"]),
            machine={str(k): str(v) for k, v in dict(raw.get("machine", {})).items()},
            build=str(raw.get("build", "")),
            sizes=sizes,
            nodes=nodes,
            links=links,
            group=replace(_build(GroupFigures, group), nodes=tuple(group.get("nodes", ())))
            if group
            else None,
            placements=placements,
            seconds=float(raw.get("seconds", 0.0)),
            notes=tuple(str(n) for n in raw.get("notes", ())),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchmarkError(f"a damaged benchmark run ({type(exc).__name__}: {exc})") from None


def runs_dir(home: Path) -> Path:
    return home / BENCHMARKS_DIR


def save(home: Path, run: Run) -> Path:
    """Write a run as BENCHMARKS_DIR/<id>.json (whole, then renamed into place)."""
    folder = runs_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run.id}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(to_json(run), indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def read(path: Path) -> Run:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchmarkError(f"cannot read benchmark run {path}: {exc}") from None
    try:
        return from_json(raw)
    except BenchmarkError as exc:
        raise BenchmarkError(f"{path}: {exc.message}") from None


def saved(home: Path) -> list[Run]:
    """Every readable saved run, newest first (unreadable files are left out)."""
    found = []
    for path in sorted(runs_dir(home).glob("*.json"), reverse=True):
        try:
            found.append(read(path))
        except BenchmarkError:
            continue
    return found


def find(home: Path, ref: str) -> Run:
    """A saved run by id, unique start of an id, `latest`, `previous`, or a file's path."""
    path = Path(ref).expanduser()
    if ref.endswith(".json") and path.is_file():
        return read(path)
    runs = saved(home)
    if ref in ("latest", "previous"):
        index = 0 if ref == "latest" else 1
        if len(runs) <= index:
            raise BenchmarkError(
                f"there is no {ref} benchmark run ({len(runs)} saved in {runs_dir(home)})",
                "run `studiotui benchmark` first",
            )
        return runs[index]
    matches = [r for r in runs if r.id == ref] or [r for r in runs if r.id.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(r.id for r in runs[:8]) or "none"
    if matches:
        raise BenchmarkError(f"{ref!r} names {len(matches)} runs", f"give more of the id ({known})")
    raise BenchmarkError(f"no saved benchmark run {ref!r} in {runs_dir(home)}", f"saved: {known}")
