"""LoRA adapters placed with their base model: real agents, runners, ZeroMQ and MLX.

The adapter is a real mlx-lm one (tests/adapter_model.py: mlx-lm's LoRA layers with
nonzero lora_b); the reference is `mlx_lm.load(model, adapter_path=adapter)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from studiotui.cluster.controller import Controller, PlacementError
from tests.adapter_model import write_adapter
from tests.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.adapters import model_digest
from worker.shared.demo_model import DemoSpec, write_demo_model

CHUNK = 16
N = 24
PROMPT = "Adapters bend a model toward the owner's own documents, layer by layer."
SPEC = DemoSpec(arch="llama", layers=4, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=7)


@pytest.fixture(scope="module")
def adapter_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("adapter-home"), 2, 71, 57700)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-models")
    base = write_demo_model(root / "tiny", SPEC)
    other = write_demo_model(root / "other", DemoSpec(**{**SPEC.__dict__, "seed": 8}))
    # Three last layers of four: both shards of an even split apply some of it.
    adapter = write_adapter(base, root / "adapters" / "style", num_layers=3)
    return {"base": base, "other": other, "adapter": adapter}


def reference(model_dir: Path, tokens: list[int], adapter: Path | None = None) -> list[int]:
    model, _ = mlx_lm.load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    steps = generate_step(mx.array(tokens), model, max_tokens=N, prefill_step_size=CHUNK)
    return [int(t) for t, _ in steps]


def encode(model_dir: Path) -> list[int]:
    _, tok = mlx_lm.load(str(model_dir))
    return list(tok.encode(PROMPT))


async def collect(ctl: Controller, placement: str, tokens: list[int]) -> list[int]:
    out: list[int] = []
    params = {"max_tokens": N, "ignore_eos": True}
    async for msg in ctl.generate(placement, {"tokens": tokens}, params):
        if msg["type"] == "delta":
            out += msg["tokens"]
    return out


def test_placed_adapter_matches_mlx_lm_over_1_and_2_shards(
    adapter_cluster: LocalCluster, made: dict[str, Path]
) -> None:
    base, adapter = made["base"], made["adapter"]
    tokens = encode(base)
    want = reference(base, tokens, adapter)
    plain = reference(base, tokens)
    assert want != plain, "the test adapter must change the answer"
    names = list(adapter_cluster.inventory.names)

    async def run() -> dict[str, object]:
        ctl = adapter_cluster.controller()
        out: dict[str, object] = {}
        try:
            await ctl.place(base, names[:1], "tiny", prefill_chunk=CHUNK)
            out["base"] = await collect(ctl, "tiny", tokens)
            for n in (1, 2):
                await ctl.place(base, names[:n], prefill_chunk=CHUNK, adapter_dir=adapter)
                placed = ctl.state.placement("tiny+style")
                assert placed is not None
                out[f"label{n}"] = (placed.label, [s.adapter for s in placed.shards])
                out[f"layers{n}"] = placed.layers
                out[n] = await collect(ctl, "tiny+style", tokens)
                await ctl.unload("tiny+style")
            await ctl.unload("tiny")
        finally:
            await ctl.close()
        return out

    got = asyncio.run(run())
    assert got["base"] == plain
    assert got[1] == want, "adapter over 1 shard diverged from mlx_lm.load(adapter_path=...)"
    assert got[2] == want, f"adapter over 2 shards {got['layers2']} diverged"
    assert got["layers2"] == [[0, 2], [2, 4]]
    assert got["label2"] == ("tiny + style", ["style", "style"])


def test_an_adapter_of_another_model_is_refused_naming_both_digests(
    adapter_cluster: LocalCluster, made: dict[str, Path]
) -> None:
    names = list(adapter_cluster.inventory.names)

    async def run() -> tuple[str, list[str], list[str]]:
        ctl = adapter_cluster.controller()
        try:
            await ctl.refresh()
            try:
                await ctl.place(made["other"], names, adapter_dir=made["adapter"])
                refused = "placed?!"
            except PlacementError as exc:
                refused = str(exc)
            return refused, [p.name for p in ctl.state.placements], [e.text for e in ctl.state.log]
        finally:
            await ctl.close()

    refused, placements, log = asyncio.run(run())
    assert "trained on tiny" in refused and "not on other" in refused, refused
    assert model_digest(made["base"])[:12] in refused
    assert model_digest(made["other"])[:12] in refused
    assert placements == []
    assert not any(line.startswith("placing") for line in log), log
