"""`studiotui bench`: how fast the pipeline runs, next to a single process and mlx-lm's own.

It generates a model, starts its own local cluster (own STUDIOTUI_HOME, own
loopback addresses), measures, and stops every agent it started by pid.

What a token costs on pipe2's ring, medians over its single-stream decode steps,
measured by its head on its own clock (worker/stage.py, `Stage._ring_figures`):

- `hop_us_p50`: one hop, from a stage's send call (the header packed in it) to the
  next stage's recv returning: what `bare_hop_us` measures between two bare
  processes, so `hop_over_bare` compares like with like.
- `frame_overhead_us_p50`: a stage's own time with a frame, from its recv returning
  to its send call, less the time it waited for MLX to evaluate (`eval`,
  `async_eval`, `item`): its Python per frame, the serve loop's queue, header
  decoding and building the next step's graph ahead included.
- `ring_overhead_us_p50`: a token's time less the MLX evaluation of every stage:
  per step, exactly two hops plus two stages' frame overhead.
- `ring_token_us_p50` / `ring_mlx_us_p50`: a token's time (the head's own with the
  frame before, plus the round) and the MLX evaluation in it, on every stage.

Each step's token time is its MLX evaluation plus its overhead, so no microsecond
goes unseen; medians of the parts need not add up to the median of the whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from rich.console import Console
from rich.table import Table

from studiotui.api.server import start_server
from studiotui.app.app import StudioApp
from studiotui.bench import batching, soak, speculative, structured, ttft
from studiotui.bench.api_bench import bench_api
from studiotui.bench.finetune import finetune_figures
from studiotui.bench.floor import PipeFloor
from studiotui.bench.kv_context import kv_context_figures
from studiotui.bench.launch import ring_of_two
from studiotui.bench.prompt_cache import cache_figures
from studiotui.bench.provision import bench_provision
from studiotui.bench.tensor import (
    mlx_tp2_launch_tps,
    mlx_tp2_tps,
    summarize_tensor,
    tensor_figures,
    versus_mlx,
)
from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller
from studiotui.cluster.session import wait_until_up
from studiotui.cluster.streams import prompt_tokens, stream
from studiotui.core.errors import StudioError
from studiotui.core.inventory import Inventory, local_inventory
from studiotui.core.placement import Plan
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

BENCH_OCTET = 71
BENCH_PORT = 56500
# The bare hop's two ends listen beside the agents (127.0.0.71-74), on an address of
# their own.
BARE_ADDRESS = f"127.0.0.{BENCH_OCTET + 4}"
# The MoE row's floor (two shard processes over bare hops) listens there too.
FLOOR_PORT = BENCH_PORT + 960
# The MoE time-to-first-token row's model: half the bench's layers, since its bfloat16
# 4-bit experts prefill slowly on MLX's CPU backend (seconds a run, both sides alike).
MOE_TTFT_LAYERS = 4


class BenchError(StudioError, RuntimeError):
    pass


PHASES: dict[str, float] = {}
# Progress goes to stderr, one line as each part starts: a run takes minutes on a busy
# machine, and stdout holds only the figures (`--json` stays one object).
progress = Console(stderr=True, highlight=False)
_FIRST_PHASE: dict[str, float] = {}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time one part of the run, so a slow bench says where its time went, and say it
    has started."""
    began = time.monotonic()
    first = _FIRST_PHASE.setdefault("at", began)
    progress.print(f"bench: {name}… ({began - first:.0f} s in)")
    try:
        yield
    finally:
        PHASES[name] = round(PHASES.get(name, 0.0) + time.monotonic() - began, 1)


@dataclass(frozen=True)
class BenchConfig:
    layers: int
    hidden: int
    tokens: int
    prefill_chunk: int = 128
    # Pairs of each time-to-first-token row (`bench.ttft`): a run is seconds of prefill.
    ttft_rounds: int = 2
    # A shared 2-vCPU machine slows whole seconds down now and then by 10-20%, so each
    # pipeline decode run is paired with a single-process run right next to it and a
    # ratio is the median of the pairs' own ratios, as the API figure does.
    decode_rounds: int = 3
    api_clients: int = 8
    # The engine on one node (no hop): separates what the shard's own speed brings from
    # what the pipeline costs. Only in the full run: --quick has no minute to spare.
    lone: bool = True

    @classmethod
    def make(cls, quick: bool) -> BenchConfig:
        if quick:
            return cls(
                layers=8,
                hidden=256,
                tokens=48,
                ttft_rounds=1,
                decode_rounds=2,
                api_clients=4,
                lone=False,
            )
        return cls(layers=8, hidden=256, tokens=256)


# ---- single process -----------------------------------------------------------------


class SingleProcess:
    """mlx-lm's own generate loop on the whole model, in this process."""

    def __init__(self, model_dir: Path) -> None:

        self.model = mlx_lm.load(str(model_dir))[0]

    def decode(self, n: int) -> dict[str, Any]:

        tokens, stamps = [], []
        for tok, _ in generate_step(mx.array(prompt_tokens(16)), self.model, max_tokens=n):
            tokens.append(int(tok))
            stamps.append(time.perf_counter())
        return {"tokens": tokens, "tps": (len(tokens) - 1) / (stamps[-1] - stamps[0])}


# ---- the pipeline -------------------------------------------------------------------


async def paired_decode(
    ctl: Controller,
    name: str,
    single: SingleProcess,
    cfg: BenchConfig,
    between: Callable[[], Awaitable[None]] | None = None,
    floor: Callable[[int], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Pipeline and single-process decode runs side by side, in alternating order;
    `between` runs right after each pipeline run. With `floor` (a blocking run of n
    tokens), each round also runs it, on the single run's other side (floor, single,
    pipeline; then the reverse), so both are paired with the same single run and each
    goes first as often; its figures are under "floor"."""
    pipe_runs, single_runs, floor_runs = [], [], []
    order = ("single", "pipe") if floor is None else ("floor", "single", "pipe")
    for r in range(cfg.decode_rounds):
        for side in order[::-1] if r % 2 else order:
            if side == "pipe":
                pipe_runs.append(await stream(ctl, name, prompt_tokens(16), cfg.tokens))
                if between is not None:
                    await between()
            elif side == "floor":
                assert floor is not None
                floor_runs.append(await asyncio.to_thread(floor, cfg.tokens))
            else:
                # In a thread, so the controller keeps hearing its nodes meanwhile.
                single_runs.append(await asyncio.to_thread(single.decode, cfg.tokens))
    out = _paired(pipe_runs, single_runs)
    out["single"] = single_runs
    if floor_runs:
        out["floor"] = _paired(floor_runs, single_runs)
    return out


def _paired(runs: list[dict[str, Any]], singles: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs over the single-process runs they were paired with: the median of the
    pairs' own ratios."""
    ratios = [p["tps"] / s["tps"] for p, s in zip(runs, singles, strict=True)]
    return {
        "runs": runs,
        "tps": statistics.median(r["tps"] for r in runs),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "tokens": [r["tokens"] for r in runs],
    }


async def pipeline_figures(
    home: Path, inv: Inventory, model_dir: Path, cfg: BenchConfig, single: SingleProcess
) -> dict[str, Any]:
    ctl = Controller(home, inv)
    out: dict[str, Any] = {}
    names = list(inv.names)
    try:
        await ctl.refresh()
        for n in (1, 2, 4) if cfg.lone else (2, 4):
            name = f"pipe{n}"
            with phase(f"place{n}"):
                await ctl.place(model_dir, names[:n], name, prefill_chunk=cfg.prefill_chunk)
            with phase(f"decode{n}"):
                await stream(ctl, name, prompt_tokens(16), 8)  # warm up
                if n == 2:
                    out[name], out["bare_hop_us"] = await _with_bare_hop(ctl, name, single, cfg)
                else:
                    out[name] = await paired_decode(ctl, name, single, cfg)
            head = ctl.head_peer(ctl.pick_placement(name))
            out[f"{name}_ring"] = ring_figures((await head.ask("stats", control.StatsReply)).stats)
            if n == 2:
                out["streams"] = {}
                for k in (1, 2, 4):
                    with phase("streams"):
                        runs = await asyncio.gather(
                            *(stream(ctl, name, prompt_tokens(16), cfg.tokens) for _ in range(k))
                        )
                    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
                    out["streams"][str(k)] = sum(len(r["tokens"]) for r in runs) / wall
                    out[f"streams{k}_tokens"] = [r["tokens"] for r in runs]

                quick = cfg.tokens < 100
                with phase("api"):
                    out["api"] = await bench_api(
                        ctl,
                        name,
                        clients=cfg.api_clients,
                        max_tokens=8 if quick else 32,
                        rounds=1 if quick else 3,
                    )
            await ctl.unload(name)
    finally:
        await ctl.close()
    return out


async def _with_bare_hop(
    ctl: Controller, name: str, single: SingleProcess, cfg: BenchConfig
) -> tuple[dict[str, Any], float | None]:
    """pipe2's paired decode runs, with the bare hop's round trips right after each: the
    floor is measured under the same load, minute by minute, as the hops are, and as
    often (a round trip per decode step of the run before)."""
    bare = await asyncio.to_thread(batching.BareHop, BARE_ADDRESS, BENCH_PORT + 950, cfg.hidden)
    floors: list[float | None] = []
    try:

        async def measure() -> None:  # (its time counts in the decode2 phase)
            began = len(bare.hops)
            await asyncio.to_thread(bare.measure, cfg.tokens)
            floors.append(bare.hop_us(since=began))

        runs = await paired_decode(ctl, name, single, hop_pairing(cfg), between=measure)
    finally:
        await asyncio.to_thread(bare.close)
    # Each run's hops over the floor measured right after it (reported beside the ratio
    # of the medians, so their spread shows).
    hops = [r.get("hop_us_p50") for r in runs["runs"]]
    runs["hop_over_bare"] = [
        hop / floor for hop, floor in zip(hops, floors, strict=True) if hop and floor
    ]
    return runs, bare.hop_us()


def hop_pairing(cfg: BenchConfig) -> BenchConfig:
    """pipe2's runs: at least three, each followed by as many round trips of the floor
    as it had decode steps, so the hop and its floor are each a median of ~150 steps
    or more, taken in turns over the same minute."""
    return replace(cfg, decode_rounds=max(3, cfg.decode_rounds))


def ring_figures(stats: control.ShardStats) -> dict[str, float]:
    """The head's medians of its decode steps (worker.stage.RING_FIGURES), as the bench
    names them; 0.0 for one it has none of."""
    return {
        "hop_us_p50": stats.hop_us_p50 or 0.0,
        "frame_overhead_us_p50": stats.frame_us_p50 or 0.0,
        "ring_overhead_us_p50": stats.overhead_us_p50 or 0.0,
        "ring_token_us_p50": stats.token_us_p50 or 0.0,
        "ring_mlx_us_p50": stats.mlx_us_p50 or 0.0,
    }


# ---- a mixture of experts -----------------------------------------------------------


def moe_spec(cfg: BenchConfig) -> Any:
    """A 4-bit qwen3_moe demo the size of the dense bench model, 8 experts (2 active).
    Scales and norms in float32 like the dense model: on MLX's CPU backend the bfloat16
    quantized expert kernel runs ~15x slower, and the figure would measure that kernel
    rather than the pipeline (on an Apple GPU both are fast)."""

    return DemoSpec(
        arch="qwen3_moe",
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=8,
        kv_heads=4,
        experts=8,
        quantize="4",
        dtype="float32",
    )


def moe_pairing(cfg: BenchConfig) -> BenchConfig:
    """How the MoE row pairs its runs. One figure stands on this row (no other row's
    single-process runs to lean on), and on a shared 2-vCPU machine a run of 48 tokens
    (a third of a second) is moved 10-20% by whatever else runs then: so more pairs,
    an even number of them (each order, single first and pipeline first, as often), each
    long enough to span a scheduler hiccup, and the median of the pairs' own ratios."""
    return replace(
        cfg,
        decode_rounds=max(4, cfg.decode_rounds + cfg.decode_rounds % 2),
        tokens=max(96, cfg.tokens),
    )


async def moe_figures(
    home: Path, inv: Inventory, model_dir: Path, cfg: BenchConfig, single: SingleProcess
) -> dict[str, Any]:
    """The MoE model over 2 shards, paired with mlx-lm's loop on it, as pipe2 is; and in
    the same rounds its floor (`floor.PipeFloor`): the same two shards of the placement,
    run by two plain processes over a bare hop each way, paired with the same runs."""
    ctl = Controller(home, inv)
    pipe_floor: PipeFloor | None = None
    try:
        await ctl.refresh()
        nodes = list(inv.names)[:2]
        # The plan is made first, so the floor's processes start loading its split while
        # the placement loads that very plan (`expected`).
        _, plan = ctl.preview(model_dir, nodes)
        if not isinstance(plan, Plan):
            raise BenchError(f"the MoE model cannot be placed on two nodes: {plan.reason}")
        split = plan.shards[0].end
        pipe_floor = PipeFloor(model_dir, split, BARE_ADDRESS, FLOOR_PORT, cfg.prefill_chunk)
        with phase("place_moe2"):
            await ctl.place(
                model_dir, nodes, "moe2", prefill_chunk=cfg.prefill_chunk, expected=plan
            )
        placed = ctl.pick_placement("moe2").shards[0].end
        if placed != split:
            raise BenchError(f"moe2 was placed split at layer {placed}, its floor at {split}")
        with phase("decode_moe2"):
            # Both sides warm: the pipeline's shards and mlx-lm's first steps (its first
            # run would otherwise pay the allocations, flattering the pipeline); and the
            # floor, once its processes have loaded.
            await stream(ctl, "moe2", prompt_tokens(16), 8)
            await asyncio.to_thread(single.decode, 8)
            floor = pipe_floor  # (a name the closure below knows is set)

            def floor_run(n: int) -> dict[str, Any]:
                return floor.decode(prompt_tokens(16), n)

            await asyncio.to_thread(floor_run, 8)
            out = await paired_decode(ctl, "moe2", single, moe_pairing(cfg), floor=floor_run)
        await ctl.unload("moe2")
    finally:
        if pipe_floor is not None:
            await asyncio.to_thread(pipe_floor.close)
        await ctl.close()
    return out


# ---- mlx-lm's own pipeline ----------------------------------------------------------


def mlx_ring(model_dir: Path, cfg: BenchConfig) -> float | None:
    script = Path(__file__).with_name("ring.py")
    out = ring_of_two(script, BENCH_PORT + 900, [str(model_dir), "16", str(cfg.tokens)])
    return float(out["tps"]) if out is not None else None


# ---- the run ------------------------------------------------------------------------


def measure(quick: bool) -> dict[str, Any]:

    cfg = BenchConfig.make(quick)
    moe: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="studiotui-bench-") as tmp:
        home = Path(tmp)
        # qwen2 is one of the families whose mlx-lm class has pipeline(), so the
        # same model runs on both pipelines.
        model_dir = write_demo_model(
            home / "models" / "bench",
            DemoSpec(
                arch="qwen2",
                layers=cfg.layers,
                hidden=cfg.hidden,
                heads=8,
                kv_heads=4,
                dtype="float32",
            ),
        )
        moe_dir = write_demo_model(home / "models" / "bench-moe", moe_spec(cfg))
        inv = local_inventory(
            4, base_octet=BENCH_OCTET, control_port=BENCH_PORT, memory_gb=8.0, home=home
        )
        # The agents boot while the single process loads its model; everything is timed
        # only once they are up and idle.
        pids = [local_cluster.start_agent(home, node, inv) for node in inv.nodes]
        try:
            with phase("single"):
                single = SingleProcess(model_dir)
            pipe = asyncio.run(_with_cluster(home, inv, model_dir, cfg, single))
            with phase("kv8"):
                kv = asyncio.run(kv_context_figures(home, inv))
            with phase("single"):
                single_moe = SingleProcess(moe_dir)
            moe = asyncio.run(moe_figures(home, inv, moe_dir, cfg, single_moe))
            del single_moe
            with phase("batch8"):
                batch = asyncio.run(
                    batching.batch_figures(
                        home, inv, model_dir, cfg.tokens, cfg.decode_rounds, cfg.prefill_chunk
                    )
                )
            with phase("speculative"):
                spec = asyncio.run(
                    speculative.spec_figures(home, inv, cfg.layers, cfg.hidden, speculative.ROUNDS)
                )
            with phase("prompt_cache"):
                cached = asyncio.run(_cache_phase(home, inv, model_dir, cfg))
            with phase("ttft"):
                firsts = asyncio.run(_ttft_phase(home, inv, model_dir, cfg))
            with phase("structured"):
                schema = asyncio.run(_structured_phase(home, inv, model_dir, cfg))

            async def paired(ctl: Controller, name: str) -> dict[str, Any]:
                await stream(ctl, name, prompt_tokens(16), 8)  # warm up
                out = await paired_decode(ctl, name, single, cfg)
                # mlx-lm's own tensor parallel beside ours, with the same agents up.
                out["versus_mlx"] = await versus_mlx(
                    lambda: stream(ctl, name, prompt_tokens(16), cfg.tokens),
                    model_dir,
                    BENCH_PORT,
                    cfg.tokens,
                    cfg.decode_rounds,
                )
                return out

            with phase("tp2"):
                tp = asyncio.run(tensor_figures(home, inv, model_dir, cfg.prefill_chunk, paired))
        except Exception as exc:  # report it as a figure-less run, not a traceback
            raise BenchError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            for pid in pids:
                local_cluster.kill_pid(pid)
        with phase("mlx_ring"):
            ring = mlx_ring(model_dir, cfg)
        with phase("mlx_tp2"):
            mlx_tp = mlx_tp2_tps(model_dir, BENCH_PORT, cfg.tokens)
            launched = None if quick else mlx_tp2_launch_tps(model_dir, BENCH_PORT, cfg.tokens)
    pipe["moe2"] = moe
    figures = summarize(pipe, ring, cfg)
    figures.update(firsts)
    figures.update(schema)
    figures.update(batch)
    figures.update(kv)
    figures.update(spec)
    figures.update(cached)
    figures["tokens_match"] = (
        figures["tokens_match"]
        and batch["batch8_tokens_match"]
        and spec["spec_tokens_match"]
        and cached["cache_tokens_match"]
        and firsts["ttft_tokens_match"]
    )
    return {**figures, **summarize_tensor(tp, mlx_tp, launched)}


async def _cache_phase(
    home: Path, inv: Inventory, model_dir: Path, cfg: BenchConfig
) -> dict[str, Any]:
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        nodes = list(inv.names)[:2]
        # A full prefill of ~4k tokens takes tens of seconds on a shared 2-vCPU
        # machine: --quick pairs once.
        rounds = 1 if cfg.tokens < 100 else cfg.decode_rounds
        return await cache_figures(ctl, model_dir, nodes, cfg.prefill_chunk, rounds)
    finally:
        await ctl.close()


async def _ttft_phase(
    home: Path, inv: Inventory, model_dir: Path, cfg: BenchConfig
) -> dict[str, Any]:
    """The time-to-first-token rows (`bench.ttft`): the dense model on a prompt of
    several prefill chunks, and a 4-bit MoE as a new user writes it on ~600 tokens."""
    moe_dir = write_demo_model(
        home / "models" / "bench-moe-ttft", ttft.moe_ttft_spec(MOE_TTFT_LAYERS, cfg.hidden)
    )
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        nodes = list(inv.names)[:2]
        dense = await ttft.ttft_figures(
            ctl, "ttft2", model_dir, nodes, ttft.CHUNKED_PROMPT, cfg.ttft_rounds
        )
        moe = await ttft.ttft_figures(
            ctl, "moe-ttft2", moe_dir, nodes, ttft.MOE_PROMPT, cfg.ttft_rounds
        )
    finally:
        await ctl.close()
    return {
        "ttft_prompt_tokens": dense["prompt"],
        "ttft_single_ms": dense["mlx_ms"],
        "ttft_pipe2_ms": dense["pipe_ms"],
        "ttft_pipe2_ratio": dense["ratio"],
        "ttft_pipe2_pairs": dense["pairs"],
        "moe_ttft_model": f"qwen3_moe demo, {MOE_TTFT_LAYERS} layers, hidden {cfg.hidden}, "
        "8 experts, 4-bit, bfloat16",
        "moe_ttft_prompt_tokens": moe["prompt"],
        "moe_ttft_single_ms": moe["mlx_ms"],
        "moe_ttft_pipe2_ms": moe["pipe_ms"],
        "moe_ttft_ratio": moe["ratio"],
        "moe_ttft_pairs": moe["pairs"],
        "ttft_tokens_match": dense["tokens_match"] and moe["tokens_match"],
    }


async def _structured_phase(
    home: Path, inv: Inventory, model_dir: Path, cfg: BenchConfig
) -> dict[str, Any]:
    """`structured_tok_ratio` (`bench.structured`) on the dense model over 2 nodes, an
    even number of pairs (each side first as often)."""
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        return await structured.structured_figures(
            ctl,
            model_dir,
            list(inv.names)[:2],
            cfg.prefill_chunk,
            cfg.tokens,
            max(2, cfg.decode_rounds + cfg.decode_rounds % 2),
        )
    finally:
        await ctl.close()


async def _agents_up(home: Path, inv: Inventory) -> None:
    """Until every bench agent answers; a RuntimeError naming those that did not start."""
    ctl = Controller(home, inv)
    try:
        missing = await wait_until_up(ctl, list(inv.names), 30.0)
    finally:
        await ctl.close()
    if missing:
        raise RuntimeError(f"bench agents {missing} did not start")


async def _with_cluster(
    home: Path, inv: Inventory, model_dir: Path, cfg: BenchConfig, single: SingleProcess
) -> dict[str, Any]:
    await _agents_up(home, inv)
    figures = await pipeline_figures(home, inv, model_dir, cfg, single)
    with phase("tui"):
        figures["tui_idle_cpu_pct"] = await tui_idle_cpu(
            home, inv, 3.0 if cfg.tokens < 100 else 10.0
        )
    return figures


async def tui_idle_cpu(home: Path, inv: Inventory, seconds: float) -> float:
    """CPU the dashboard itself uses, idle, with every node sending telemetry at 1 Hz."""

    app = StudioApp(home, inv)
    async with app.run_test(size=(160, 48)) as pilot:
        deadline = time.monotonic() + 20
        want = f"{len(inv.nodes)}/{len(inv.nodes)} nodes up"
        while want not in str(app.sub_title) and time.monotonic() < deadline:
            await pilot.pause(0.2)
        await pilot.pause(1.0)
        wall, cpu = time.monotonic(), time.process_time()
        await pilot.pause(seconds)
        return 100.0 * (time.process_time() - cpu) / (time.monotonic() - wall)


def summarize(pipe: dict[str, Any], ring: float | None, cfg: BenchConfig) -> dict[str, Any]:
    singles = [r for n in (1, 2, 4) for r in pipe.get(f"pipe{n}", {}).get("single", [])]
    s = statistics.median(r["tps"] for r in singles)
    expected = singles[0]["tokens"]
    streams = pipe["streams"]
    produced = [r["tokens"] for r in singles] + pipe["pipe2"]["tokens"] + pipe["pipe4"]["tokens"]
    produced += pipe["streams1_tokens"] + pipe["streams2_tokens"] + pipe["streams4_tokens"]
    lone = pipe.get("pipe1")
    if lone:
        produced += lone["tokens"]
    ring_us = {name: round(value, 1) for name, value in pipe["pipe2_ring"].items()}
    bare = pipe.get("bare_hop_us")
    pairs = pipe["pipe2"].get("hop_over_bare", []) if bare else []
    moe = pipe.get("moe2")
    moe_match = True
    floor = moe.get("floor") if moe else None
    if moe:
        # Its own reference: every MoE run, either side and the floor, gives the same
        # tokens.
        moe_runs = [r["tokens"] for r in moe["single"]] + moe["tokens"]
        moe_runs += floor["tokens"] if floor else []
        moe_match = all(t == moe_runs[0] for t in moe_runs)
    return {
        "model": f"qwen2 demo, {cfg.layers} layers, hidden {cfg.hidden}, float32",
        "tokens": cfg.tokens,
        "single_tps": round(s, 2),
        "pipe1_tps": round(lone["tps"], 2) if lone else None,
        "pipe1_ratio": round(lone["ratio"], 3) if lone else None,
        "pipe2_tps": round(pipe["pipe2"]["tps"], 2),
        "pipe4_tps": round(pipe["pipe4"]["tps"], 2),
        "pipe2_ratio": round(pipe["pipe2"]["ratio"], 3),
        "pipe4_ratio": round(pipe["pipe4"]["ratio"], 3),
        "streams": {k: round(v, 2) for k, v in streams.items()},
        "streams4_ratio": round(streams["4"] / s, 3),
        "mlx_ring2_tps": round(ring, 2) if ring is not None else None,
        **ring_us,
        "bare_hop_us": round(bare, 1) if bare else None,
        # The medians of all pipe2 steps' hops and of all the floor's, taken in turns
        # and as many: a pair of one run (~50 steps, half a second) and the floor right
        # after it moved 0.5-1.5 within a run, more than the minutes do (below).
        "hop_over_bare": round(ring_us["hop_us_p50"] / bare, 2) if bare else None,
        # Each pipe2 run's hop over the floor measured right after it, so the spread shows.
        "hop_over_bare_pairs": [round(r, 2) for r in pairs],
        "moe_model": f"qwen3_moe demo, {cfg.layers} layers, hidden {cfg.hidden}, 8 experts, 4-bit"
        if moe
        else None,
        "moe_single_tps": round(statistics.median(r["tps"] for r in moe["single"]), 2)
        if moe
        else None,
        "moe_pipe2_tps": round(moe["tps"], 2) if moe else None,
        "moe_pipe2_ratio": round(moe["ratio"], 3) if moe else None,
        # Each pair's own ratio, so the spread behind the median shows.
        "moe_pipe2_pairs": [round(r, 3) for r in moe["ratios"]] if moe else None,
        # The floor: the same two shards in two plain processes over a bare hop each way,
        # paired with the same single runs; and the pipeline's ratio over it.
        "moe_pipe2_floor_tps": round(floor["tps"], 2) if floor else None,
        "moe_pipe2_floor_ratio": round(floor["ratio"], 3) if floor else None,
        "moe_pipe2_floor_pairs": [round(r, 3) for r in floor["ratios"]] if floor else None,
        "moe_pipe2_over_floor": round(moe["ratio"] / floor["ratio"], 3) if moe and floor else None,
        "tokens_match": all(p == expected for p in produced) and moe_match,
        "tui_idle_cpu_pct": round(pipe["tui_idle_cpu_pct"], 2),
        "api_tps": round(pipe["api"]["api_tps"], 2),
        "api_direct_tps": round(pipe["api"]["direct_tps"], 2),
        "api_overhead_ratio": round(pipe["api"]["api_overhead_ratio"], 3),
    }


def run_bench(quick: bool, as_json: bool) -> int:

    started = time.monotonic()
    figures = measure(quick)
    if quick:
        # Provisioning and fine-tuning are measured by the full bench: with them, --quick
        # overruns a minute.
        figures["provision4_ratio"] = figures["reprovision_s"] = None
        figures["finetune2_ratio"] = None
    else:
        with phase("finetune"):
            figures.update(finetune_figures(quick=False))
        with tempfile.TemporaryDirectory(prefix="studiotui-bench-ssh-") as tmp, phase("provision"):
            figures.update(asyncio.run(bench_provision(Path(tmp))))
    figures["bench_seconds"] = round(time.monotonic() - started, 1)
    figures["phases_s"] = dict(PHASES)
    if as_json:
        print(json.dumps(figures))
    else:
        Console().print(figures_table(figures))
    return 0 if figures["tokens_match"] else 1


FIGURES_SAID = (
    "_tps: tokens/s · _ms, _us: milli-, microseconds · _s: seconds · _pct: % of one core · "
    "_ratio: above 1 is faster than what it is compared with (mostly a single mlx-lm "
    "process run beside it) · not measured: left out of this run (--quick leaves out "
    "provisioning and fine-tuning). docs/performance.md explains each figure."
)


def figures_table(figures: dict[str, Any]) -> Table:
    """The figures as a user reads them: units and ratios said under the table, a
    figure this run did not measure said so (not "None")."""
    table = Table(title="studiotui bench", caption=FIGURES_SAID)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        shown = "not measured" if value is None else value
        table.add_row(key, json.dumps(shown) if isinstance(shown, dict | list) else str(shown))
    return table


# ---- speculative decoding only ---------------------------------------------------------


def run_speculative(quick: bool, as_json: bool) -> int:
    """`studiotui bench --speculative`: only the speculative decoding rows, on two agents
    of their own (the full bench measures them too)."""
    cfg = BenchConfig.make(quick)
    rounds = speculative.ROUNDS
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="studiotui-bench-spec-") as tmp:
        home = Path(tmp)
        figures = _on_agents(home, 2, lambda inv: _speculative_cluster(home, inv, cfg, rounds))
    figures["bench_seconds"] = round(time.monotonic() - started, 1)
    if as_json:
        print(json.dumps(figures))
    else:
        Console().print(figures_table(figures))
    return 0 if figures["spec_tokens_match"] else 1


def _on_agents(
    home: Path, n: int, run: Callable[[Inventory], Coroutine[Any, Any, dict[str, Any]]]
) -> dict[str, Any]:
    """`run` on n bench agents of their own under `home`, stopped by pid however it ends;
    a failure is a figure-less run (BenchError), not a traceback."""
    inv = local_inventory(
        n, base_octet=BENCH_OCTET, control_port=BENCH_PORT, memory_gb=8.0, home=home
    )
    pids = [local_cluster.start_agent(home, node, inv) for node in inv.nodes]
    try:
        return asyncio.run(run(inv))
    except Exception as exc:
        raise BenchError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for pid in pids:
            local_cluster.kill_pid(pid)


async def _speculative_cluster(
    home: Path, inv: Inventory, cfg: BenchConfig, rounds: int
) -> dict[str, Any]:
    await _agents_up(home, inv)
    with phase("speculative"):
        return await speculative.spec_figures(home, inv, cfg.layers, cfg.hidden, rounds)


# ---- soak -----------------------------------------------------------------------------


def run_soak(quick: bool, as_json: bool) -> int:
    """`studiotui bench --soak`: a cancel storm, then many requests over concurrent
    OpenAI clients, on a cluster of its own; figures on lost, mixed and memory."""

    requests, storm = (48, 20) if quick else (200, 50)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="studiotui-soak-") as tmp:
        home = Path(tmp)
        model_dir = write_demo_model(
            home / "models" / "soak",
            DemoSpec(arch="qwen2", layers=8, hidden=128, heads=8, kv_heads=4, dtype="float32"),
        )
        figures = _on_agents(
            home, 3, lambda inv: _soak_cluster(home, inv, model_dir, requests, storm)
        )
    figures["soak_seconds"] = round(time.monotonic() - started, 1)
    if as_json:
        print(json.dumps(figures))
    else:
        table = Table(title="studiotui bench --soak")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for key, value in figures.items():
            table.add_row(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
        Console().print(table)
    ok = figures["soak_lost"] == 0 and figures["soak_mixed"] == 0
    return 0 if ok and not any(figures["storm_caches_after"]) else 1


async def _soak_cluster(
    home: Path, inv: Inventory, model_dir: Path, requests: int, storm: int
) -> dict[str, Any]:

    ctl = Controller(home, inv)
    try:
        missing = await wait_until_up(ctl, list(inv.names), 30.0)
        if missing:
            raise RuntimeError(f"soak agents {missing} did not start")
        await ctl.place(model_dir, list(inv.names), "soak", prefill_chunk=128)
        tokens = prompt_tokens(64)
        began = time.monotonic()
        stormed = await soak.cancel_storm(ctl, "soak", tokens, n=storm, at_once=10)
        figures: dict[str, Any] = {
            "storm_requests": stormed.started,
            "storm_failed": len(stormed.failed),
            "storm_caches_after": stormed.caches_after,
            "storm_seconds": round(time.monotonic() - began, 1),
        }
        server = await start_server(ctl, "127.0.0.1", 0)
        try:
            result = await soak.soak(ctl, server.url, "soak", requests=requests, clients=8)
        finally:
            await server.close()
        figures.update(result.figures())
        figures["soak_errors"] = result.errors[:5]
        return figures
    finally:
        await ctl.close()
