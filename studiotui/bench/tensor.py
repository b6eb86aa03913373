"""The bench's tensor-parallel figures: our 2-way tensor group beside mlx-lm's own.

`tp2_tps` / `tp2_ratio`: the bench model placed as one stage run by a tensor group of
two local nodes (MLX's ring backend on loopback), decoded next to mlx-lm's loop in one
process, paired run by run as the pipeline figures are. `mlx_tp2_ratio`: mlx-lm's own
tensor parallel (`mlx.launch --backend ring -n 2`, `model.shard()`, tp_rank.py) on the
same model in the same run, over the same single-process figure. On a 2-vCPU machine
the ring backend busy-polls while it waits for the other rank, so both are below 1
here; the comparison that matters is ours against mlx-lm's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from studiotui.bench.launch import ring_of_two
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory
from studiotui.core.placement import Plan

TP_PORT_OFFSET = 950


def tensor_plan(ctl: Controller, model_dir: Path, nodes: list[str]) -> Plan:
    """The planner's one-node plan, run by a tensor group of `nodes` on the ring backend."""
    _, one = ctl.preview(model_dir, nodes[:1])
    if not isinstance(one, Plan):
        raise RuntimeError(f"the bench model does not fit one node: {one.reason}")
    stage = dataclasses.replace(
        one.shards[0], group=tuple(nodes), backend="ring", backend_reason="bench: loopback"
    )
    return dataclasses.replace(one, shards=(stage,))


async def tensor_figures(
    home: Path,
    inv: Inventory,
    model_dir: Path,
    prefill_chunk: int,
    measure: Callable[[Controller, str], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Place the model as a tensor group of the first two nodes, `measure` it (the
    bench's paired decode), unload it."""
    ctl = Controller(home, inv)
    nodes = list(inv.names)[:2]
    try:
        await ctl.refresh()
        plan = tensor_plan(ctl, model_dir, nodes)
        await ctl.place(model_dir, nodes, "tp2", expected=plan, prefill_chunk=prefill_chunk)
        out = await measure(ctl, "tp2")
        await ctl.unload("tp2")
    finally:
        await ctl.close()
    return out


def mlx_tp2_tps(model_dir: Path, port: int, tokens: int) -> dict[str, Any] | None:
    """mlx-lm's own 2-way tensor parallel on this machine: tokens/s and its tokens."""
    script = Path(__file__).with_name("tp_rank.py")
    return ring_of_two(script, port + TP_PORT_OFFSET, [str(model_dir), "16", str(tokens)])


def summarize_tensor(tp: dict[str, Any] | None, mlx: dict[str, Any] | None) -> dict[str, Any]:
    if not tp:
        return dict.fromkeys(
            ("tp2_tps", "tp2_ratio", "mlx_tp2_tps", "mlx_tp2_ratio", "tp2_tokens_match")
        )
    single = statistics.median(r["tps"] for r in tp["single"])
    # Not part of tokens_match: a sum re-associated over ranks may flip a near-tie token
    # of a 256-token float32 answer (tests/integration/test_tensor_parallel.py judges
    # only where the margin allows); reported so a difference is seen.
    want = tp["single"][0]["tokens"]
    answers = list(tp["tokens"]) + ([mlx["tokens"]] if mlx else [])
    return {
        "tp2_tps": round(tp["tps"], 2),
        "tp2_ratio": round(tp["ratio"], 3),
        "mlx_tp2_tps": round(mlx["tps"], 2) if mlx else None,
        "mlx_tp2_ratio": round(mlx["tps"] / single, 3) if mlx else None,
        "tp2_tokens_match": all(a == want for a in answers),
    }
