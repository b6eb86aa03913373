"""Tensor-parallel stages on real agents: mlx-lm's `shard()`, MLX's ring backend on loopback.

A tensor group of 2 (one stage on two nodes) and a 2 x 2 hybrid (two stages, each a
group of two) answer with mlx-lm's greedy tokens on the same directory, for a dense
(qwen3) and a mixture-of-experts family (qwen3_moe), float32 and 4-bit.

The criterion, and why: a tensor group sums each layer's partial products across the
ranks (`all_sum`), so its float32 logits differ from one process's by re-association,
measured at most 4.5e-5 on these models (logits up to ~26). A greedy token can flip
only where mlx-lm's own top two logits are closer than that. So the test compares the
answer up to the first step whose top-1/top-2 margin (from mlx-lm's log-probabilities,
the same differences as the logits) is below MARGIN, 200 times the error seen, and
requires that prefix to be at least MIN_COMPARED tokens long: a model whose margins
were too thin to judge fails the test rather than passing it vacuously.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from studiotui.cluster.controller import Controller, GenerationError, PlacementError
from studiotui.core.placement import Plan
from tests.support.answers import greedy_with_margins
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

pytestmark = pytest.mark.integration

BASE, PORT = 91, 57300
PROMPT = list(range(40, 62))
N_TOKENS = 16
MARGIN = 1e-2
MIN_COMPARED = 12
MODELS = {
    # 384 = 2 x 3 groups of 64: every sharded 4-bit width splits on a group boundary.
    "dense": DemoSpec(arch="qwen3", layers=4, hidden=128, heads=8, kv_heads=4, intermediate=384),
    "moe": DemoSpec(arch="qwen3_moe", layers=4, hidden=128, heads=8, kv_heads=4),
}
CASES = [(m, q) for m in MODELS for q in ("float", "4bit")]
# Every case as one group of two; the 2 x 2 hybrid (four runners a placement) on a dense
# float and a MoE 4-bit model, so each shape sees both families and both precisions and
# the module stays within its time (each runner costs a second of imports on 2 vCPUs).
# And one stage x 4 (a ring of four ranks), as the planner makes it (place(tensor=4)).
SHAPED = [(case, "tp2") for case in CASES] + [
    (("dense", "float"), "2x2"),
    (("moe", "4bit"), "2x2"),
    (("dense", "float"), "1x4"),
]


def _spec(kind: str, quant: str) -> DemoSpec:
    return dataclasses.replace(
        MODELS[kind], dtype="float32", seed=5, quantize="4" if quant == "4bit" else None
    )


def _reference(model: Path, **processors: Any) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens and, per step, its top-1 minus top-2 log-probability,
    with `processors` (make_logits_processors' options) if given."""
    return greedy_with_margins(model, PROMPT, N_TOKENS, make_logits_processors(**processors))


def _grouped(plan: Plan, partner: dict[str, str]) -> Plan:
    """The planner's pipeline with each stage run by a group of two: the stage's own node
    leads, `partner[node]` follows (a tensor group's figures are per node)."""
    shards = tuple(
        dataclasses.replace(
            s, group=(s.node, partner[s.node]), backend="ring", backend_reason="test"
        )
        for s in plan.shards
    )
    return dataclasses.replace(plan, shards=shards)


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("tp"), 4, BASE, PORT)


@pytest.fixture(scope="module")
def placed(
    tp_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, list[int]]]]:
    """Every model in every shape, placed at once (loads overlap), then each asked once."""
    root = tmp_path_factory.mktemp("tp-models")
    models = {f"{k}-{q}": write_demo_model(root / f"{k}-{q}", _spec(k, q)) for k, q in CASES}

    async def run() -> dict[str, dict[str, list[int]]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            a, b, c, d = tp_cluster.inventory.names
            jobs = []
            for name, model in models.items():
                _, one = ctl.preview(model, [a])
                _, two = ctl.preview(model, [a, c])
                assert isinstance(one, Plan) and isinstance(two, Plan)
                for shape, plan, nodes in (("tp2", one, [a, b]), ("2x2", two, [a, b, c, d])):
                    if (tuple(name.split("-")), shape) not in SHAPED:
                        continue
                    jobs.append(
                        ctl.place(
                            model,
                            nodes,
                            f"{name}-{shape}",
                            expected=_grouped(plan, {a: b, c: d}),
                            prefill_chunk=8,
                        )
                    )
            # The planner's own group of four (its shapes; this engine runs them).
            four = ctl.place(
                models["dense-float"], [a, b, c, d], "dense-float-1x4", prefill_chunk=8, tensor=4
            )
            placed = await asyncio.gather(four, *jobs)
            assert [len(s.group) for s in placed[0].plan.shards] == [4]
            answers: dict[str, dict[str, list[int]]] = {}
            for (kind, quant), shape in SHAPED:
                name = f"{kind}-{quant}"
                answers.setdefault(name, {})[shape] = await _answer(ctl, f"{name}-{shape}")
            return answers
        finally:
            await ctl.close()

    answers = asyncio.run(run())
    return {name: (models[name], answers[name]) for name in models}


async def _answer(
    ctl: Controller, placement: str, prompt: list[int] = PROMPT, n: int = N_TOKENS, **more: Any
) -> list[int]:
    got: list[int] = []
    params = {"max_tokens": n, "ignore_eos": True, **more}
    async for msg in ctl.generate(placement, {"tokens": prompt}, params):
        if isinstance(msg, control.Delta):
            got += msg.tokens
    return got


@pytest.mark.parametrize(("case", "shape"), SHAPED)
def test_tensor_group_answers_as_mlx_lm(
    placed: dict[str, tuple[Path, dict[str, list[int]]]], case: tuple[str, str], shape: str
) -> None:
    model, answers = placed["-".join(case)]
    want, margins = _reference(model)
    judged = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    assert judged >= MIN_COMPARED, f"margins too thin to judge {model.name}: {margins}"
    assert len(set(want[:judged])) > 2, "a model that repeats one token tests little"
    assert answers[shape][:judged] == want[:judged]


@pytest.mark.parametrize("shape", ["tp2", "2x2"])
def test_logits_processors_on_a_group_answer_as_mlx_lm(
    tp_cluster: LocalCluster, placed: dict[str, tuple[Path, object]], shape: str
) -> None:
    """Every rank of the tail's group applies the request's processors to the same
    all-reduced logits with the same recent tokens: the group draws mlx-lm's tokens."""
    model, _ = placed["dense-float"]
    options = {"repetition_penalty": 1.4, "presence_penalty": 0.8, "logit_bias": {50: 3.0}}
    want, margins = _reference(model, **options)
    assert want != _reference(model)[0], "the processors change nothing: they test nothing"
    judged = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    assert judged >= MIN_COMPARED, f"margins too thin to judge: {margins}"

    async def run() -> list[int]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            wire = {**options, "logit_bias": [[50, 3.0]]}
            return await _answer(ctl, f"dense-float-{shape}", **wire)
        finally:
            await ctl.close()

    assert asyncio.run(run())[:judged] == want[:judged]


@pytest.mark.parametrize("shape", ["tp2", "2x2"])
def test_samplers_on_a_group_draw_as_mlx_lm(
    tp_cluster: LocalCluster, placed: dict[str, tuple[Path, dict[str, list[int]]]], shape: str
) -> None:
    """Every rank of the tail's group seeds mlx-lm's `make_sampler` with the request's
    own keys and draws from the same all-reduced logits, so all draw the same token
    (the followers build the next step on their own draw): mlx-lm's seeded tokens. The
    whole answer is compared: a draw flips only where two tokens' noisy scores lie
    within the group's rounding of each other, and the greedy test above finds this
    model's margins far wider than that. top_k=1 is the greedy answer."""
    model, answers = placed["dense-float"]
    loaded, _ = mlx_lm.load(str(model))

    def reference(**options: Any) -> list[int]:
        mx.random.seed(9)
        steps = generate_step(
            mx.array(PROMPT),
            loaded,
            max_tokens=N_TOKENS,
            prefill_step_size=8,
            sampler=make_sampler(**options),
        )
        return [int(tok) for tok, _ in steps]

    want = reference(temp=1.3, top_k=4, min_p=0.05)
    assert want != reference(temp=1.3), "top_k and min_p change nothing: they test nothing"
    sampled = {"temperature": 1.3, "seed": 9}

    async def run() -> tuple[list[int], list[int]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            placement = f"dense-float-{shape}"
            return (
                await _answer(ctl, placement, **sampled, top_k=4, min_p=0.05),
                await _answer(ctl, placement, **sampled, top_k=1),
            )
        finally:
            await ctl.close()

    got, first = asyncio.run(run())
    assert got == want
    assert first == answers[shape]


def test_members_report_their_group(tp_cluster: LocalCluster, placed: dict[str, object]) -> None:
    async def run() -> list[tuple[str, int, tuple[str, ...], int]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            p = ctl.state.placement("moe-4bit-2x2")
            assert p is not None and p.state == "ready"
            return [(s.node, s.rank, s.group, s.index) for s in p.shards]
        finally:
            await ctl.close()

    shards = asyncio.run(run())
    assert len(shards) == 4
    # Stage by stage, each group's leader (rank 0) first: the head's leader serves clients.
    assert [(rank, index) for _, rank, _, index in shards] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert shards[0][2] == (shards[0][0], shards[1][0])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_group_reuses_a_conversation_s_history_on_every_rank(
    tp_cluster: LocalCluster, placed: dict[str, tuple[Path, dict[str, list[int]]]], kind: str
) -> None:
    """The next turn of a conversation reuses the first turn's prompt and answer, on the
    leader and its follower alike (each copies its slice of the entry, the follower as
    it runs the leader's items): mlx-lm's tokens for the whole second prompt."""
    model, answers = placed[f"{kind}-float"]
    turn2 = PROMPT + answers["tp2"] + [90, 91, 92]
    loaded, _ = mlx_lm.load(str(model))
    want, margins = [], []
    for tok, logprobs in generate_step(mx.array(turn2), loaded, max_tokens=8, prefill_step_size=8):
        top2 = mx.sort(logprobs)[-2:]
        want.append(int(tok))
        margins.append(float((top2[1] - top2[0]).item()))
    judged = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    assert judged >= 6, f"margins too thin to judge: {margins}"

    async def run() -> tuple[list[int], int]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            got: list[int] = []
            cached = -1
            params = {"max_tokens": 8, "ignore_eos": True}
            async for msg in ctl.generate(f"{kind}-float-tp2", {"tokens": turn2}, params):
                if isinstance(msg, control.Delta):
                    got += msg.tokens
                elif isinstance(msg, control.Done):
                    cached = msg.usage["cached_tokens"]
            return got, cached
        finally:
            await ctl.close()

    got, cached = asyncio.run(run())
    assert cached >= len(PROMPT), "turn 1 (prompt and answer) was reused"
    assert got[:judged] == want[:judged]


@pytest.mark.parametrize("shape", ["tp2", "2x2"])
def test_guesses_on_a_group_answer_as_mlx_lm(
    tp_cluster: LocalCluster, tmp_path: Path, shape: str
) -> None:
    """Speculation on a tensor group and on a pipeline of groups (`--draft lookup`, fed
    by a predicted output wrong at its 6th token): every rank computes the verify steps
    and cuts its slice of the caches back alike. Alone, and two at once (their guesses
    verified in one batched step), the greedy answers are mlx-lm's."""
    model = write_demo_model(tmp_path / "dense", _spec("dense", "float"))
    want, margins = _reference(model)
    judged = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
    assert judged >= MIN_COMPARED, f"margins too thin to judge: {margins}"
    prediction = [*want[:5], (want[5] + 1) % 256, *want[6:]]
    name = f"spec-{shape}"

    async def ask(ctl: Controller) -> tuple[list[int], dict[str, Any]]:
        got: list[int] = []
        usage: dict[str, Any] = {}
        params = {"max_tokens": N_TOKENS, "ignore_eos": True}
        request = {"tokens": PROMPT, "prediction": prediction}
        async for msg in ctl.generate(name, request, params):
            if isinstance(msg, control.Delta):
                got += msg.tokens
            elif isinstance(msg, control.Done):
                usage = msg.usage
        return got, usage

    async def run() -> list[tuple[list[int], dict[str, Any]]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            a, b, c, d = tp_cluster.inventory.names
            nodes = [a, b] if shape == "tp2" else [a, b, c, d]
            _, plan = ctl.preview(model, [a] if shape == "tp2" else [a, c])
            assert isinstance(plan, Plan)
            grouped = _grouped(plan, {a: b, c: d})
            await ctl.place(model, nodes, name, expected=grouped, prefill_chunk=8, draft="lookup")
            try:
                alone = await ask(ctl)
                together = await asyncio.gather(ask(ctl), ask(ctl))
                return [alone, *together]
            finally:
                await ctl.unload(name)
        finally:
            await ctl.close()

    for got, usage in asyncio.run(run()):
        assert got[:judged] == want[:judged]
        details = usage["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= 5
        assert details["rejected_prediction_tokens"] >= 1


def test_a_draft_model_on_a_head_group_is_refused_in_words(
    tp_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Every rank of a head group must guess alike, and a draft model is loaded on one
    node: refused before any node prepares anything."""
    model = write_demo_model(tmp_path / "dense", _spec("dense", "float"))
    draft = write_demo_model(
        tmp_path / "draft", dataclasses.replace(_spec("dense", "float"), layers=1)
    )

    async def run() -> None:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            a, b, _, _ = tp_cluster.inventory.names
            _, plan = ctl.preview(model, [a])
            assert isinstance(plan, Plan)
            with pytest.raises(PlacementError, match="a draft model runs on one head node"):
                await ctl.place(
                    model,
                    [a, b],
                    "spec-model",
                    expected=_grouped(plan, {a: b}),
                    draft_dir=str(draft),
                )
            assert ctl.state.placement("spec-model") is None
        finally:
            await ctl.close()

    asyncio.run(run())


@pytest.mark.parametrize("placement", ["dense-float-tp2", "moe-4bit-2x2"])
def test_concurrent_requests_on_a_group_answer_as_alone(
    tp_cluster: LocalCluster, placed: dict[str, object], placement: str
) -> None:
    """Requests arriving while others decode and prefill are where the followers must
    put each outside item exactly where the leader ran it: three at once, each the same
    as alone, greedy (bit-identical: the same group computes both)."""
    prompts = [PROMPT, PROMPT[5:] * 2, list(range(90, 130))]

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            alone = [await _answer(ctl, placement, p, 8) for p in prompts]
            together = await asyncio.gather(*(_answer(ctl, placement, p, 8) for p in prompts))
            return alone, list(together)
        finally:
            await ctl.close()

    alone, together = asyncio.run(run())
    assert all(len(a) == 8 for a in alone)
    assert together == alone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its agent) counts as gone.
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.parametrize("victim_rank", [1, 0])
def test_a_member_killed_mid_answer_is_named_within_3_s(
    tp_cluster: LocalCluster, placed: dict[str, object], victim_rank: int
) -> None:
    """SIGKILL one rank of a 2x2 hybrid's second stage while it answers: the request
    fails within 3 s naming that node, the placement shows failed, and unloading
    leaves no process of it behind."""
    name = ["dense-float-2x2", "moe-4bit-2x2"][victim_rank]

    async def run() -> tuple[float, str, str, list[int]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            p = ctl.state.placement(name)
            assert p is not None and p.state == "ready"
            victim = [s for s in p.shards if s.index == 1][victim_rank].node
            pids = []
            for node in p.nodes:
                reply = await ctl.peer(node).ask("list_shards", control.Shards)
                pids += [s.pid for s in reply.shards if s.placement == name]
            victim_pid = pids[p.nodes.index(victim)]
            got, killed_at, error = 0, 0.0, "no error?!"
            try:
                params = {"max_tokens": 100000, "ignore_eos": True}
                async for msg in ctl.generate(name, {"tokens": PROMPT}, params):
                    got += isinstance(msg, control.Delta)
                    if got == 3:
                        os.kill(victim_pid, signal.SIGKILL)  # a runner our own agent started
                        killed_at = time.monotonic()
            except GenerationError as exc:
                error = f"{exc} [{victim}]"
            took = time.monotonic() - killed_at
            await ctl.refresh()
            state = ctl.state.placement(name).state  # type: ignore[union-attr]
            await ctl.unload(name)
            return took, error, state, [pid for pid in pids if _alive(pid)]
        finally:
            await ctl.close()

    took, error, state, left = asyncio.run(run())
    victim = error.rsplit("[", 1)[-1].rstrip("]")
    assert f"on {victim} (stage" in error and "is down" in error and "exited" in error, error
    assert took < 3.0, f"reported after {took:.1f} s"
    assert state == "failed"
    assert left == [], f"processes left after unloading: {left}"


def test_a_group_the_model_cannot_split_is_refused_and_rolled_back(
    tp_cluster: LocalCluster, tmp_path: Path
) -> None:
    """mixtral's mlx-lm class has no shard(); a 4-bit qwen3 whose MLP width (320) is 5
    quantization groups of 64 cannot be halved. Each load fails with its reason, every member
    of the group is unloaded, and nothing of either placement stays."""
    cases = {
        "no-shard": (
            DemoSpec(arch="mixtral", layers=2, hidden=128, heads=8, kv_heads=4),
            "shard()",
        ),
        "odd": (
            DemoSpec(
                arch="qwen3",
                layers=2,
                hidden=128,
                heads=8,
                kv_heads=4,
                intermediate=320,
                quantize="4",
            ),
            "cannot be split 2 ways",
        ),
    }
    models = {
        name: write_demo_model(tmp_path / name, dataclasses.replace(spec, dtype="float32"))
        for name, (spec, _) in cases.items()
    }

    async def run() -> tuple[dict[str, str], list[str]]:
        ctl = tp_cluster.controller()
        try:
            await ctl.refresh()
            a, b, _, _ = tp_cluster.inventory.names

            async def attempt(name: str) -> str:
                _, one = ctl.preview(models[name], [a])
                assert isinstance(one, Plan)
                try:
                    await ctl.place(models[name], [a, b], name, expected=_grouped(one, {a: b}))
                except PlacementError as exc:
                    return str(exc)
                return "placed?!"

            errors = dict(zip(cases, await asyncio.gather(*map(attempt, cases)), strict=True))
            await ctl.refresh()
            left = [p.name for p in ctl.state.placements if p.name in cases]
            return errors, left
        finally:
            await ctl.close()

    errors, left = asyncio.run(run())
    for name, (_, words) in cases.items():
        assert "rolled back" in errors[name] and words in errors[name], (name, errors[name])
    assert left == []
