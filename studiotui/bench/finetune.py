"""`finetune2_ratio`: training tokens/s of a fine-tuning job on 2 nodes ÷ on 1 node.

Same model, same data, same global batch (so the same training, as
tests/integration/test_finetune.py shows for the first step): the 2-node job gives
each node half of every batch and MLX averages the gradients over its ring. The two
run one after the other, alternating, on a cluster of their own; the figure is the
median of the pairs' ratios. A job's rate is the median of its reports after the
first few (mlx-lm compiles the step on the first ones).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller
from studiotui.cluster.session import wait_until_up
from studiotui.core.inventory import Inventory, local_inventory
from studiotui.core.jobs import JobWatch
from studiotui.tune import finetune as ft
from worker.shared.demo_model import DemoSpec, write_demo_model

FT_OCTET, FT_PORT = 77, 56800  # 127.0.0.77-78, apart from the other benches
WARMUP_REPORTS = 3
# Per step, the ranks sync three times (gradients, and the reported loss and token count);
# a batch this big keeps that a small part of a step.
BATCH = 16
# A sentence about what is measured, its words rotated into examples of 12-15 words.
SENTENCE = (
    "the cluster trains one adapter while every node reads its own share of each "
    "batch and the ring averages what they learned before the next step begins"
)
WORDS = SENTENCE.split()


def bench_data(path: Path, n: int = 160) -> Path:
    rows = [
        {"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12 + i % 4))} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_rate(watch: JobWatch, rates: list[float]) -> float:
    """Median tokens/s of a job's reports after the warm-up ones."""
    kept = rates[WARMUP_REPORTS:] or rates
    if not kept:
        raise RuntimeError(f"job {watch.name} reported no rate: {watch.progress.message}")
    return statistics.median(kept)


async def _one_job(ctl: Controller, req: ft.FinetuneRequest) -> float:
    record = await ft.launch(ctl, ft.prepare(ctl, req))
    watch = JobWatch(record.name, record.kind, list(record.nodes))
    rates: list[float] = []
    seen = [0]

    def changed() -> None:
        p = watch.progress
        if p.train_loss and p.train_loss[-1].iteration != seen[0] and p.tokens_per_second:
            seen[0] = p.train_loss[-1].iteration
            # The newest report's own rate (JobWatch smooths over several).
            rates.append(p.last_tokens_per_second or 0.0)

    end = await ft.attach(ctl, record, watch, changed)
    if end.state != "done":
        raise RuntimeError(f"bench job {record.name} {end.state}: {end.message}")
    return job_rate(watch, rates)


async def _pairs(
    home: Path, inv: Inventory, model: Path, data: Path, iters: int, rounds: int
) -> dict[str, Any]:
    names = list(inv.names)
    ctl = Controller(home, inv)
    await ctl.start(telemetry=False)
    one: list[float] = []
    two: list[float] = []
    try:
        for r in range(rounds):
            for nodes, out in ((tuple(names[:1]), one), (tuple(names), two)):
                req = ft.FinetuneRequest(
                    str(model),
                    str(data),
                    nodes,
                    f"bench{len(nodes)}-{r}",
                    iters=iters,
                    batch_size=8,
                    learning_rate=1e-4,
                    save_every=iters,
                    steps_per_eval=iters,
                    val_batches=1,
                )
                out.append(await _one_job(ctl, req))
    finally:
        await ctl.close()
    ratios = [b / a for a, b in zip(one, two, strict=True)]
    return {
        "finetune1_tps": round(statistics.median(one), 1),
        "finetune2_tps": round(statistics.median(two), 1),
        "finetune2_ratio": round(statistics.median(ratios), 3),
    }


def finetune_figures(quick: bool) -> dict[str, Any]:
    """Tokens/s of LoRA training on 1 and 2 nodes of a local cluster, and their ratio."""
    iters, rounds = (6, 1) if quick else (20, 2)
    with tempfile.TemporaryDirectory(prefix="studiotui-bench-ft-") as tmp:
        home = Path(tmp)
        model = write_demo_model(
            home / "models" / "ft",
            DemoSpec(arch="qwen2", layers=4, hidden=128, heads=8, kv_heads=4, dtype="float32"),
        )
        data = bench_data(home / "data.jsonl")
        inv = local_inventory(2, base_octet=FT_OCTET, control_port=FT_PORT, home=home)
        pids = [local_cluster.start_agent(home, node, inv) for node in inv.nodes]
        try:
            asyncio.run(_wait(home, inv))
            figures = asyncio.run(_pairs(home, inv, model, data, iters, rounds))
        finally:
            for pid in pids:
                local_cluster.kill_pid(pid)
    figures["finetune_model"] = "qwen2 demo, 4 layers, hidden 128, float32, LoRA rank 8"
    return figures


async def _wait(home: Path, inv: Inventory) -> None:
    ctl = Controller(home, inv)
    try:
        missing = await wait_until_up(ctl, list(inv.names), 30.0)
    finally:
        await ctl.close()
    if missing:
        raise RuntimeError(f"fine-tuning bench agents {missing} did not start")
