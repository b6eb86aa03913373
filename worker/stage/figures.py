"""The ring's timing: what the head measures of each decode step's round."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from worker.stage.base import StageBase

_T = TypeVar("_T")


class Figures(StageBase):
    """The ring's timing: what the head measures of each decode step's round."""

    def _start_frame(self, arrived: float | None = None) -> None:
        self.frame_began = time.perf_counter() if arrived is None else arrived
        self.frame_mlx_s = 0.0

    def _mlx(self, evaluate: Callable[..., _T], *args: Any) -> _T:
        """Wait for MLX (an `eval`, `async_eval` or `item`), counting the time: the
        ring's figures tell it apart from the Python around it."""
        began = time.perf_counter()
        try:
            return evaluate(*args)
        finally:
            self.frame_mlx_s += time.perf_counter() - began

    def _carry(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The step's timing so far, for the next stage's frame: the head's time with
        its frame (`head_us`), the other stages' (`work_us`: each from its recv to
        its send), and the MLX evaluation of them all (`mlx_us`)."""
        spent = (time.perf_counter() - self.frame_began) * 1e6
        mlx = float(extra.get("mlx_us", 0.0)) + self.frame_mlx_s * 1e6
        if self.shard.is_first:
            return {"head_us": spent, "mlx_us": mlx}
        work = float(extra.get("work_us", 0.0)) + spent
        return {"head_us": float(extra.get("head_us", 0.0)), "work_us": work, "mlx_us": mlx}

    def _ring_figures(self, ring_s: float, extra: dict[str, Any]) -> float:
        """(head) A decode step's round, `ring_s` from its frame's send call to its
        token's recv, both on this node's clock: what the stages spent is in the token
        frame, so no clocks are compared across nodes. The step's time (the head's own
        with the frame before, plus the round) is MLX's evaluation on every stage plus
        the ring's overhead, which is the hops plus each stage's Python. Returns the
        step's hop."""
        ring, head = ring_s * 1e6, float(extra.get("head_us", 0.0))
        work, mlx = float(extra.get("work_us", 0.0)), float(extra.get("mlx_us", 0.0))
        token = ring + head
        figures = {
            "hop": (ring - work) / self.hops,
            "frame": (work + head - mlx) / self.hops,
            "overhead": token - mlx,
            "token": token,
            "mlx": mlx,
        }
        for name, value in figures.items():
            self.ring_us[name].append(max(0.0, value))
        return max(0.0, figures["hop"])
