"""Batched decode across the ring: requests in flight decoded together, each answer equal
to the same request alone (and, greedy, to mlx-lm's), joining and leaving at random.

Randomness is seeded (`random.Random(SEED)`): which request starts when, how long each
answer is, which are sampled and which is cancelled. In-process rings (real shards, real
`Stage`s, frames as bytes through a work queue) pick the interleaving from the same seed,
so a failure replays; through real agents and ZeroMQ the timing of the ring decides
which requests meet in a batch, and the equality must hold whatever it decides.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from studiotui.cluster.controller import Controller
from tests.support.cluster_fixture import LocalCluster
from tests.support.ring_harness import CHUNK, InProcessRing
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control
from worker.shared.protocol.frames import (
    RingHeader,
)

SEED = 15
PROMPT = list(range(40, 70))


def spec(arch: str, quantize: str | None = None, dtype: str = "float32") -> DemoSpec:
    return DemoSpec(
        arch=arch, layers=5, hidden=64, heads=4, kv_heads=2, dtype=dtype, seed=11,
        quantize=quantize,
    )  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("batching")
    made: dict[str, Path] = {}

    def get(arch: str, quantize: str | None = None, dtype: str = "float32") -> Path:
        key = f"{arch}-{quantize}-{dtype}"
        if key not in made:
            made[key] = write_demo_model(root / key, spec(arch, quantize, dtype))
        return made[key]

    return get


def reference(model: Path, prompt: list[int], n: int) -> list[int]:
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(mx.array(prompt), loaded, max_tokens=n, prefill_step_size=CHUNK)
    return [int(tok) for tok, _ in steps]


def workload(
    n: int, rng: random.Random, shortest: int = 8
) -> list[tuple[list[int], dict[str, Any]]]:
    """n requests of different prompt and answer lengths, greedy or sampled with a seed."""
    out = []
    for _ in range(n):
        prompt = PROMPT[: rng.randint(6, len(PROMPT))]
        params: dict[str, Any] = {"max_tokens": rng.randint(shortest, 40), "ignore_eos": True}
        if rng.random() < 0.5:
            params |= {"temperature": 1.2, "top_p": 0.95, "seed": rng.randint(0, 999)}
        out.append((prompt, params))
    return out


# ---- in process ------------------------------------------------------------------------


class Ring(InProcessRing):
    """The stages of one placement in one process; frames cross a work queue as bytes."""

    def __init__(self, model: Path, ranges: list[tuple[int, int]], batch: bool = True) -> None:
        super().__init__(model, ranges, streams=8, batch=batch)

    def submit(self, rid: str, prompt: list[int], params: dict[str, Any]) -> None:
        self.stages[0].submit(b"c", {"rid": rid, "params": params, "tokens": prompt})

    def holds(self, rid: str) -> bool:
        return any(
            rid in s.caches or rid in s.group_of or rid in s.tail_requests for s in self.stages
        )


def alone(ring: Ring, jobs: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
    answers = []
    for i, (prompt, params) in enumerate(jobs):
        ring.submit(f"alone{i}", prompt, params)
        ring.drain()
        answers.append(ring.tokens(f"alone{i}"))
    return answers


def together(
    ring: Ring, jobs: list[tuple[list[int], dict[str, Any]]], rng: random.Random, cancel: int
) -> tuple[list[list[int]], int]:
    """Start the jobs at random moments of each other's decoding; cancel job `cancel`
    once it decodes in a batch. Returns the answers, and how many requests were still
    in flight when the cancelled one's caches were gone from every stage."""
    waiting = list(enumerate(jobs))
    others_on = -1
    while waiting or ring.work:
        if waiting and (not ring.work or rng.random() < 0.4):
            i, (prompt, params) = waiting.pop(0)
            ring.submit(f"t{i}", prompt, params)
        ring.drain(rng.randint(1, 5))
        rid = f"t{cancel}"
        if others_on < 0 and any(rid in s.group_of for s in ring.stages):
            ring.stages[0].cancel(rid)
            while ring.holds(rid) and ring.work:
                ring.drain(1)
            assert not ring.holds(rid), "a cancelled request's caches must be freed"
            others_on = sum(ring.holds(f"t{i}") for i in range(len(jobs)))
    return [ring.tokens(f"t{i}") for i in range(len(jobs))], others_on


@pytest.mark.parametrize(
    ("arch", "ranges"),
    [
        ("llama", [(0, 2), (2, 5)]),
        ("llama", [(0, 5)]),
        ("qwen3-bfloat16", [(0, 2), (2, 5)]),  # bfloat16 rows travel as their bits
        ("qwen3_moe", [(0, 2), (2, 5)]),
        ("gpt_oss", [(0, 3), (3, 5)]),  # sliding layers: RotatingKVCache
        ("qwen3_next", [(0, 2), (2, 5)]),  # linear attention: ArraysCache
        ("deepseek_v32", [(0, 2), (2, 5)]),  # CacheList
    ],
)
def test_requests_joining_and_leaving_a_batch_match_each_alone(
    models: Callable[..., Path], arch: str, ranges: list[tuple[int, int]]
) -> None:
    rng = random.Random(SEED)
    n = 8 if len(ranges) == 2 and arch == "llama" else 5
    jobs = workload(n, rng)
    jobs[2][1]["max_tokens"] = 40  # the one cancelled: long enough to meet the others
    family, _, dtype = arch.partition("-")
    ring = Ring(models(family, dtype=dtype or "float32"), ranges)
    expected = alone(ring, jobs)
    assert all(s.stats.batched == 0 for s in ring.stages), "one at a time: nothing to batch"
    got, others_on = together(ring, jobs, rng, cancel=2)
    cancelled = got.pop(2)
    assert cancelled == expected.pop(2)[: len(cancelled)] and cancelled
    assert got == expected
    assert others_on > 0, "the others were still decoding when the cancel was freed"
    # Batches really formed, on every stage alike, and every cache is gone.
    steps = [(s.stats.batched, s.stats.batched_rows) for s in ring.stages]
    assert steps[0][0] > 0 and steps[0][1] > 2 * steps[0][0] - 1, steps
    assert len(set(steps)) == 1, steps
    assert [s.held() for s in ring.stages] == [0] * len(ranges)
    assert not any(s.groups or s.tail_requests or s.prebuilt for s in ring.stages)
    assert all(s.stats.errors == 0 for s in ring.stages)


def test_stop_strings_and_logprobs_in_a_batch(models: Callable[..., Path]) -> None:
    # A stop string ends a row at the head after its next step has started; logprobs
    # travel per row. Both as when alone.
    model = models("llama")
    ring = Ring(model, [(0, 2), (2, 5)])
    base = {"max_tokens": 20, "ignore_eos": True}
    ring.submit("probe", PROMPT, base)
    ring.drain()
    text = "".join(f["text"] for k, f in ring.client if k == "delta" and f["rid"] == "probe")
    stop = text[8:11]
    jobs = [(PROMPT, {**base, "stop": [stop]}), (PROMPT[:20], {**base, "logprobs": 3})]
    jobs += [(PROMPT[:12], base), (PROMPT[:25], {**base, "temperature": 0.9, "seed": 4})]
    expected = alone(ring, jobs)
    expected_lp = [f["logprobs"] for k, f in ring.client if k == "delta" and f["rid"] == "alone1"]
    for i, (prompt, params) in enumerate(jobs):
        ring.submit(f"t{i}", prompt, params)
    ring.drain()
    assert [ring.tokens(f"t{i}") for i in range(4)] == expected
    assert [f["logprobs"] for k, f in ring.client if k == "delta" and f["rid"] == "t1"] == (
        expected_lp
    )
    assert ring.stages[0].stats.batched > 0
    assert [s.held() for s in ring.stages] == [0, 0]


def test_a_stage_that_does_not_batch_decodes_each_request_alone(
    models: Callable[..., Path],
) -> None:
    # The fallback for caches mlx-lm cannot batch: per-request forwards, same tokens.
    rng = random.Random(SEED)
    jobs = workload(4, rng)
    ring = Ring(models("llama"), [(0, 2), (2, 5)], batch=False)
    expected = alone(ring, jobs)
    for i, (prompt, params) in enumerate(jobs):
        ring.submit(f"t{i}", prompt, params)
    ring.drain()
    assert [ring.tokens(f"t{i}") for i in range(4)] == expected
    assert all(s.stats.batched == 0 for s in ring.stages)


# ---- through real agents and ZeroMQ ----------------------------------------------------


async def answer(
    ctl: Controller, name: str, prompt: list[int], params: dict[str, Any], delay: float,
    cancel_after: int = 0,
) -> list[int]:  # fmt: skip
    await asyncio.sleep(delay)
    out: list[int] = []
    async for msg in ctl.generate(name, {"tokens": prompt}, params):
        if isinstance(msg, control.Delta):
            out += msg.tokens
            if cancel_after and len(out) >= cancel_after:
                break  # the generator sends cancel
    return out


@pytest.mark.parametrize(("arch", "quantize"), [("llama", None), ("qwen3_moe", "4")])
def test_batched_decode_over_two_real_shards_matches_each_answer_alone(
    engine_cluster: LocalCluster, models: Callable[..., Path], arch: str, quantize: str | None
) -> None:
    model = models(arch, quantize)
    rng = random.Random(SEED)
    # Answers long enough, and starts close enough, that requests meet however fast
    # this machine runs today; where they meet, and in which batch, is the ring's.
    jobs = workload(8, rng, shortest=24)
    delays = [rng.uniform(0.0, 0.15) for _ in jobs]
    greedy = [i for i, (_, p) in enumerate(jobs) if "temperature" not in p]
    mlx = {i: reference(model, jobs[i][0], jobs[i][1]["max_tokens"]) for i in greedy[:2]}

    async def run() -> tuple[list[list[int]], list[list[int]], list[list[int]], Any, list[int]]:
        ctl = engine_cluster.controller()
        name = f"batch-{arch}"
        try:
            await ctl.refresh()
            names = list(engine_cluster.inventory.names)[:2]
            await ctl.place(model, names, name, prefill_chunk=CHUNK, streams=8)
            one = [await answer(ctl, name, p, q, 0.0) for p, q in jobs]
            four = await asyncio.gather(
                *(
                    answer(ctl, name, p, q, d)
                    for (p, q), d in zip(jobs[:4], delays[:4], strict=True)
                )
            )
            eight = await asyncio.gather(
                *(
                    answer(ctl, name, p, q, d, cancel_after=4 if i == 5 else 0)
                    for i, ((p, q), d) in enumerate(zip(jobs, delays, strict=True))
                )
            )
            asked = await ctl.head_peer(ctl.pick_placement(name)).ask("stats", control.StatsReply)
            head = control.to_wire(asked.stats)
            freed = await _caches_freed(ctl, name)
            await ctl.unload(name)
            return one, list(four), list(eight), head, freed
        finally:
            await ctl.close()

    one, four, eight, head, freed = asyncio.run(run())
    for i, tokens in mlx.items():
        assert one[i] == tokens, f"request {i} alone differs from mlx-lm"
    assert four == one[:4]
    cut = eight.pop(5)
    assert cut == one[5][: len(cut)] and len(cut) >= 4
    assert eight == one[:5] + one[6:]
    # Batches formed (a row count per step above one), and every cache was freed.
    assert head["batched_steps"] > 0, head
    assert head["batched_rows"] / head["batched_steps"] > 1.5, head
    assert freed == [0, 0]
    # The head timed its steps, batched ones among them (worker/stage.py, `_ring_figures`):
    # per step, the overhead is two hops plus two stages' Python per frame, and the
    # token's time that overhead plus MLX's evaluation, none of them negative; so the
    # medians keep those orders.
    assert head["hop_us_p50"] > 0 and head["frame_us_p50"] > 0 and head["mlx_us_p50"] > 0
    assert head["overhead_us_p50"] >= 2 * max(head["hop_us_p50"], head["frame_us_p50"])
    assert head["token_us_p50"] >= max(head["overhead_us_p50"], head["mlx_us_p50"])


async def _caches_freed(ctl: Controller, name: str) -> list[int]:
    """KV caches alive per shard, once the runners' 1 s stats have caught up."""
    counts: list[int] = []
    for _ in range(40):
        await asyncio.sleep(0.25)
        await ctl.refresh()
        counts = [s.in_flight for s in ctl.state.placement(name).shards]
        if not any(counts):
            break
    return counts


def test_a_batch_frame_that_cannot_be_read_fails_its_rows_only(
    models: Callable[..., Path],
) -> None:
    # A runner that cannot read a frame reports an error under the name the frame gave,
    # here a lane's batch: the requests of that step fail, the other lane's go on.
    ring = Ring(models("llama"), [(0, 2), (2, 5)])
    jobs = [(PROMPT[: 10 + i], {"max_tokens": 30, "ignore_eos": True}) for i in range(4)]
    expected = alone(ring, jobs)
    for i, (prompt, params) in enumerate(jobs):
        ring.submit(f"t{i}", prompt, params)
    head = ring.stages[0]
    while not any(len(lane.flying) > 1 and lane.gid in head.groups for lane in head.lanes):
        ring.drain(1)
    lane = next(lane for lane in head.lanes if len(lane.flying) > 1 and lane.gid in head.groups)
    broken = set(lane.flying)
    bad = RingHeader(rid=lane.gid, kind="error", message="bad frame: payload cut short")
    ring.stages[1].on_frame(bad, b"")
    ring.drain()
    failed = {f["rid"] for k, f in ring.client if k == "failed"}
    assert failed == broken and "payload cut short" in str(ring.client)
    for i in range(4):
        if f"t{i}" not in broken:
            assert ring.tokens(f"t{i}") == expected[i]
    assert [s.held() for s in ring.stages] == [0, 0]


def test_a_request_failing_as_it_joins_a_batch_fails_alone(models: Callable[..., Path]) -> None:
    # The tail builds a request's next step ahead while its first decode step computes;
    # that build fails (as MLX does out of memory) for "t1". When its lane next steps,
    # "t1" fails there and then; the other rows of that step go on.
    ring = Ring(models("llama"), [(0, 2), (2, 5)])
    jobs = [(PROMPT[: 10 + i], {"max_tokens": 24, "ignore_eos": True}) for i in range(4)]
    expected = alone(ring, jobs)
    tail = ring.stages[1]
    forward, calls = tail.shard.forward, {"n": 0}

    def failing(h: mx.array, caches: Any) -> mx.array:
        if caches is tail.caches.get("t1") and h.shape[1] == 1:
            calls["n"] += 1
            if calls["n"] == 2:  # its first decode step ran; the one built ahead fails
                raise RuntimeError("[metal::malloc] out of memory")
        return forward(h, caches)

    tail.shard.forward = failing  # type: ignore[method-assign]
    for i, (prompt, params) in enumerate(jobs):
        ring.submit(f"t{i}", prompt, params)
    ring.drain()
    failed = [f for k, f in ring.client if k == "failed"]
    assert [f["rid"] for f in failed] == ["t1"] and "out of memory" in failed[0]["message"]
    for i in (0, 2, 3):
        assert ring.tokens(f"t{i}") == expected[i]
    assert ring.stages[0].stats.batched > 0
    assert [s.held() for s in ring.stages] == [0, 0]
