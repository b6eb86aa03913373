"""Speed and time left of a transfer, from the progress figures a callback reports.

Pure bookkeeping, shared by the CLI and the TUI's progress blocks: a node's phase
(copying its files, then loading its shard) restarts the clock whenever its total
changes or its count goes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_SECONDS = 0.5  # before this, a rate is noise
# A 700 GB base's first hashing reports every 4 MB, a copy every chunk: a view draws
# them at most 10 times a second (call_from_thread waits for the loop each time).
SHOWN_EVERY_S = 0.1


@dataclass(frozen=True)
class Mark:
    started: float
    base: int
    total: int


@dataclass
class Rates:
    marks: dict[str, Mark] = field(default_factory=dict)

    def update(self, node: str, done: int, total: int, now: float) -> None:
        mark = self.marks.get(node)
        if mark is None or mark.total != total or done < mark.base:
            self.marks[node] = Mark(now, done, total)

    def speed(self, node: str, done: int, now: float) -> float | None:
        """Bytes a second since the phase started, None while too early to say."""
        mark = self.marks.get(node)
        if mark is None or now - mark.started < MIN_SECONDS or done <= mark.base:
            return None
        return (done - mark.base) / (now - mark.started)

    def text(self, node: str, done: int, total: int, now: float) -> str:
        """`12.3 MB/s, 0:42 left`, or '' when there is nothing to say yet."""
        speed = self.speed(node, done, now)
        if speed is None or not total or done >= total:
            return ""
        return f"{format_speed(speed)}, {format_eta((total - done) / speed)} left"


@dataclass
class Paced:
    """Which progress reports a view draws: the first and the last, and between them
    at most one every `every_s`."""

    every_s: float = SHOWN_EVERY_S
    last: float = 0.0

    def due(self, done: int, total: int, now: float) -> bool:
        if done in (0, total) or now - self.last >= self.every_s:
            self.last = now
            return True
        return False


def format_speed(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def format_eta(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
