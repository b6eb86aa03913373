"""The engine end to end: real agents, real runner processes, real ZeroMQ, real MLX."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from studiotui.cluster.controller import Controller, GenerationError, PlacementError
from studiotui.core.model_facts import read_model
from tests.conftest import FAMILIES
from tests.support.cluster_fixture import LocalCluster
from worker.shared.demo_model import PASSAGE, DemoSpec, write_demo_model
from worker.shared.protocol import control

CHUNK = 16
N_TOKENS = 64
PROMPT = "The cluster of four studios hums along; every layer runs where memory allows it."


def reference_tokens(model_dir: Path, prompt_tokens: list[int], n: int) -> list[int]:
    model, _ = mlx_lm.load(str(model_dir))
    steps = generate_step(mx.array(prompt_tokens), model, max_tokens=n, prefill_step_size=CHUNK)
    return [int(tok) for tok, _ in steps]


def prompt_tokens(model_dir: Path, text: str = PROMPT) -> list[int]:
    _, tok = mlx_lm.load(str(model_dir))
    return list(tok.encode(text))


async def collect(
    ctl: Controller, placement: str, tokens: list[int], n: int, **params: Any
) -> tuple[list[int], str, control.Done | None]:
    out: list[int] = []
    text = ""
    done: control.Done | None = None
    params = {"max_tokens": n, "ignore_eos": True, **params}
    async for msg in ctl.generate(placement, {"tokens": tokens}, params):
        if isinstance(msg, control.Delta):
            out += msg.tokens
            text += msg.text
        elif isinstance(msg, control.Done):
            done = msg
    return out, text, done


async def place(ctl: Controller, model: Path, nodes: list[str], name: str) -> None:
    await ctl.place(model, nodes, name, prefill_chunk=CHUNK)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipelines_match_mlx_lm(
    engine_cluster: LocalCluster, family_models: dict[str, Path], family: str
) -> None:
    model = family_models[family]
    tokens = prompt_tokens(model)
    assert len(tokens) > CHUNK + 1, "the prompt must span more than one prefill chunk"
    expected = reference_tokens(model, tokens, N_TOKENS)
    names = list(engine_cluster.inventory.names)

    async def run() -> dict[int, tuple[list[int], list[list[int]], int]]:
        ctl = engine_cluster.controller()
        results = {}
        try:
            await ctl.refresh()
            for n in (1, 2, 3, 4):
                name = f"{family}-{n}"
                await place(ctl, model, names[:n], name)
                layers = ctl.state.placement(name).layers
                got, _, _ = await collect(ctl, name, tokens, N_TOKENS)
                head = ctl.head_peer(ctl.pick_placement(name))
                stats = (await head.ask("stats", control.StatsReply)).stats
                results[n] = (got, layers, stats.prebuilt_steps)
                await ctl.unload(name)
        finally:
            await ctl.close()
        return results

    for n, (got, layers, prebuilt) in asyncio.run(run()).items():
        # Every decode step but the first ran on a graph built ahead of its input (a lone
        # stage builds it on the lazy token, like mlx-lm), so the equality covers that.
        assert prebuilt >= N_TOKENS - 2, f"only {prebuilt} prebuilt steps over {n} shards"
        assert len(layers) == n
        assert layers[0][0] == 0 and layers[-1][1] == 7
        assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))
        assert got == expected, f"{family} over {n} shards {layers} diverged"


def test_bf16_activations_cross_the_wire(engine_cluster: LocalCluster, tmp_path: Path) -> None:
    model = write_demo_model(
        tmp_path / "bf16",
        DemoSpec(arch="qwen3", layers=5, hidden=64, heads=4, kv_heads=2, dtype="bfloat16"),
    )
    tokens = prompt_tokens(model)
    expected = reference_tokens(model, tokens, 32)

    async def run() -> list[int]:
        ctl = engine_cluster.controller()
        try:
            await place(ctl, model, list(engine_cluster.inventory.names[:3]), "bf16")
            got, _, _ = await collect(ctl, "bf16", tokens, 32)
            await ctl.unload("bf16")
            return got
        finally:
            await ctl.close()

    assert asyncio.run(run()) == expected


def test_the_reciting_demo_answers_its_passage_through_the_ring(
    engine_cluster: LocalCluster, tmp_path: Path
) -> None:
    # What a newcomer's first chat gets: the first-run demo model, sampled as the chat
    # screen samples, across two shards, ending at end-of-turn on its own.
    spec = DemoSpec(layers=4, hidden=64, heads=4, kv_heads=2, recite=True)
    model = write_demo_model(tmp_path / "recite", spec)
    request = {"messages": [{"role": "user", "content": "What are you?"}]}

    async def answer(ctl: Controller, params: dict[str, Any]) -> tuple[str, control.Done | None]:
        text, done = "", None
        async for msg in ctl.generate("recite", request, params):
            if isinstance(msg, control.Delta):
                text += msg.text
            elif isinstance(msg, control.Done):
                done = msg
        return text, done

    Answer = tuple[str, control.Done | None]

    async def run() -> tuple[Answer, Answer, list[int]]:
        ctl = engine_cluster.controller()
        try:
            await place(ctl, model, list(engine_cluster.inventory.names[:2]), "recite")
            params = {"max_tokens": 200, "temperature": 0.7, "top_p": 0.95, "seed": 3}
            whole = await answer(ctl, params)
            # A stop string is found by the head, which detokenises; the tail, still
            # going, must be told to free the request too.
            cut = await answer(ctl, {**params, "stop": ["every shard"]})
            in_flight = await wait_caches_freed(ctl, "recite")
            await ctl.unload("recite")
            return whole, cut, in_flight
        finally:
            await ctl.close()

    (text, done), (cut, cut_done), in_flight = asyncio.run(run())
    assert text == PASSAGE
    assert done is not None and cut_done is not None
    assert done.finish_reason == "stop"
    assert cut == PASSAGE[: PASSAGE.index("every shard")]
    assert cut_done.finish_reason == "stop"
    assert cut_done.usage["completion_tokens"] < done.usage["completion_tokens"]
    assert in_flight == [0, 0]


def test_concurrent_requests_match_alone_and_cancel_frees(
    engine_cluster: LocalCluster, family_models: dict[str, Path]
) -> None:
    model = family_models["llama"]
    prompts = [
        prompt_tokens(model, f"request number {i}: " + PROMPT[: 20 + 9 * i]) for i in range(4)
    ]

    async def run() -> tuple[list[list[int]], list[list[int]], list[int]]:
        ctl = engine_cluster.controller()
        try:
            await place(ctl, model, list(engine_cluster.inventory.names[:2]), "conc")
            alone = [
                (await collect(ctl, "conc", p, 40, temperature=0.7, seed=i))[0]
                for i, p in enumerate(prompts)
            ]
            together = await asyncio.gather(
                *(
                    collect(ctl, "conc", p, 40, temperature=0.7, seed=i)
                    for i, p in enumerate(prompts)
                )
            )
            # Cancel: stop consuming after a few tokens; the generator sends cancel.
            seen = 0
            async for msg in ctl.generate(
                "conc", {"tokens": prompts[0]}, {"max_tokens": 500, "ignore_eos": True}
            ):
                seen += isinstance(msg, control.Delta)
                if seen == 3:
                    break
            in_flight = await wait_caches_freed(ctl, "conc")
            await ctl.unload("conc")
            return alone, [t for t, _, _ in together], in_flight
        finally:
            await ctl.close()

    alone, together, in_flight = asyncio.run(run())
    assert together == alone
    assert len({tuple(t) for t in alone}) == 4, "different prompts/seeds should differ"
    assert in_flight == [0, 0]


async def wait_caches_freed(ctl: Controller, placement: str) -> list[int]:
    """KV caches alive per shard, once the runners' 1 s stats have caught up."""
    counts: list[int] = []
    for _ in range(40):
        await asyncio.sleep(0.25)
        await ctl.refresh()
        counts = [s.in_flight for s in ctl.state.placement(placement).shards]
        if not any(counts):
            break
    return counts


def test_shards_hold_only_their_own_bytes(
    engine_cluster: LocalCluster, family_models: dict[str, Path]
) -> None:
    model = family_models["qwen2"]
    info = read_model(model)
    total = sum(info.facts.layer_bytes) + info.facts.embed_bytes + info.facts.head_bytes

    async def run() -> list[tuple[int, int, int]]:
        ctl = engine_cluster.controller()
        try:
            await place(ctl, model, list(engine_cluster.inventory.names[:3]), "bytes")
            out = [(s.start, s.end, s.param_bytes) for s in ctl.state.placement("bytes").shards]
            await ctl.unload("bytes")
            return out
        finally:
            await ctl.close()

    shards = asyncio.run(run())
    assert sum(b for _, _, b in shards) == total
    for i, (start, end, got) in enumerate(shards):
        own = sum(info.facts.layer_bytes[start:end])
        own += info.facts.embed_bytes if i == 0 else 0
        own += info.facts.head_bytes if i == len(shards) - 1 else 0
        assert got == own


def test_bad_models_and_placements_are_refused_clearly(
    engine_cluster: LocalCluster, tmp_path: Path, family_models: dict[str, Path]
) -> None:
    corrupt = write_demo_model(
        tmp_path / "corrupt", DemoSpec(layers=4, hidden=32, heads=4, kv_heads=2)
    )
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    broken_config = tmp_path / "badjson"
    broken_config.mkdir()
    (broken_config / "config.json").write_text("{not json")
    names = list(engine_cluster.inventory.names[:2])

    async def run() -> dict[str, str]:
        ctl = engine_cluster.controller()
        out = {}
        try:
            await ctl.refresh()
            for label, path in (
                ("missing", tmp_path / "nope"),
                ("corrupt", corrupt),
                ("badjson", broken_config),
            ):
                try:
                    await ctl.place(path, names, label)
                    out[label] = "placed?!"
                except (PlacementError, ValueError) as exc:
                    out[label] = str(exc)
            try:
                async for _ in ctl.generate("no-such-placement", {"prompt": "hi"}, {}):
                    pass
            except GenerationError as exc:
                out["unknown"] = str(exc)
            await ctl.refresh()
            out["left"] = repr([p.name for p in ctl.state.placements])
        finally:
            await ctl.close()
        return out

    out = asyncio.run(run())
    assert "does not exist" in out["missing"]
    assert "corrupt" in out["corrupt"] or "cannot" in out["corrupt"]
    assert "not valid JSON" in out["badjson"]
    assert "no placement named 'no-such-placement'" in out["unknown"]
    assert out["left"] == "[]", "a failed placement must leave nothing loaded"


def test_a_shard_dying_mid_answer_fails_the_request_clearly(
    engine_cluster: LocalCluster, family_models: dict[str, Path]
) -> None:
    import os
    import signal

    model = family_models["mistral"]
    tokens = prompt_tokens(model)

    async def run() -> tuple[int, str, list[str], str]:
        ctl = engine_cluster.controller()
        got = 0
        try:
            names = list(engine_cluster.inventory.names[1:4])
            await place(ctl, model, names, "dies")
            middle = ctl.state.placement("dies").shards[1]
            reply = await ctl.peer(middle.node).ask("list_shards", control.Shards)
            pid = next(s.pid for s in reply.shards if s.placement == "dies")
            assert pid is not None
            try:
                async for msg in ctl.generate(
                    "dies", {"tokens": tokens}, {"max_tokens": 100000, "ignore_eos": True}
                ):
                    got += isinstance(msg, control.Delta)
                    if got == 5:
                        os.kill(pid, signal.SIGKILL)  # a runner our own agent started
                error = "no error?!"
            except GenerationError as exc:
                error = str(exc)
            await ctl.unload("dies")
            await ctl.refresh()
            return got, error, [p.name for p in ctl.state.placements], middle.node
        finally:
            await ctl.close()

    got, error, left, node = asyncio.run(run())
    assert got >= 5, "the partial answer arrived before the failure"
    assert "'dies'" in error and node in error and "exited" in error
    assert "dies" not in left


def test_context_budget_refuses_long_prompts_and_ends_answers(
    engine_cluster: LocalCluster, family_models: dict[str, Path]
) -> None:
    model = family_models["qwen2"]
    long_prompt = prompt_tokens(model, PROMPT * 2)
    short_prompt = long_prompt[:50]
    assert len(long_prompt) > 64

    async def run() -> tuple[str, int, str, int]:
        ctl = engine_cluster.controller()
        try:
            await ctl.place(
                model, list(engine_cluster.inventory.names[:2]), "ctx", context_tokens=64
            )
            context = ctl.state.placement("ctx").context_tokens
            try:
                await collect(ctl, "ctx", long_prompt, 10)
                refused = "answered?!"
            except GenerationError as exc:
                refused = str(exc)
            got, _, done = await collect(ctl, "ctx", short_prompt, 100)
            await ctl.unload("ctx")
            assert done is not None
            return refused, len(got), done.finish_reason, context
        finally:
            await ctl.close()

    refused, n, finish, context = asyncio.run(run())
    assert context == 64
    assert f"the prompt has {len(long_prompt)} tokens" in refused and "context of 64" in refused
    assert n == 64 - 50 and finish == "length"
