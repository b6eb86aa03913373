"""Quantized KV and the prompt cache's memory budget over real agents and runners.

`place --kv-bits` reaches every runner (the tokens are mlx-lm's with the same quantized
caches), and the prompt cache's budget is shown in the preview, reported by every node
with its shard and counted in the node's memory like weights and KV: a second placement
is never promised the same bytes.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from studiotui.cli.exits import REFUSED
from studiotui.cli.main import main
from studiotui.cli.status_cmd import status_json
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import dump_inventory
from studiotui.core.memory import RUNNER_OVERHEAD_BYTES, node_promised_bytes
from studiotui.core.placement import Plan, Refusal
from tests.integration.test_kv_quant import quantized_cache
from tests.support.cluster_fixture import LocalCluster
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

CHUNK = 16
N_TOKENS = 24
GIB = 1024**3
# Head width 32: groups of 32.
SPEC = DemoSpec(arch="llama", layers=5, hidden=128, heads=4, kv_heads=2, dtype="float32", seed=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("kvq-models") / "kvq", SPEC)


def reference(model_dir: Path, tokens: list[int], bits: int, group: int) -> list[int]:
    loaded, _ = mlx_lm.load(str(model_dir))
    steps = generate_step(
        mx.array(tokens),
        loaded,
        max_tokens=N_TOKENS,
        prefill_step_size=CHUNK,
        prompt_cache=quantized_cache(loaded, bits, group),
    )
    return [int(tok) for tok, _ in steps]


async def answer(ctl: Controller, name: str, tokens: list[int]) -> list[int]:
    out: list[int] = []
    params = {"max_tokens": N_TOKENS, "ignore_eos": True, "temperature": 0.0}
    async for msg in ctl.generate(name, {"tokens": tokens}, params):
        if isinstance(msg, control.Delta):
            out += msg.tokens
    return out


def test_kv_bits_reach_every_runner_and_match_mlx_lm(
    engine_cluster: LocalCluster, model: Path
) -> None:
    tokens = list(range(30, 70))  # three prefill chunks
    expected = reference(model, tokens, 4, 32)
    nodes = list(engine_cluster.inventory.names[:2])

    async def run() -> None:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            _, full = ctl.preview(model, nodes, 4096, 1)
            result = await ctl.place(
                model, nodes, "kvq4", prefill_chunk=CHUNK, streams=1, kv_bits=4, kv_group_size=32
            )
            planned = result.plan
            assert isinstance(full, Plan)
            # 4-bit K/V of 32-wide float32 heads: 16 bytes + a scale and a bias (8): a
            # fifth of the 128 bytes of full precision.
            assert sum(s.kv_bytes for s in planned.shards) < 0.2 * sum(
                s.kv_bytes for s in full.shards
            )
            assert any("decode one at a time" in note for note in planned.notes)
            placed = ctl.state.placement("kvq4")
            assert placed is not None
            assert {(s.kv_bits, s.kv_group_size) for s in placed.shards} == {(4, 32)}
            (shown,) = [p for p in status_json(ctl)["placements"] if p["name"] == "kvq4"]
            assert shown["kv_bits"] == 4
            assert shown["prompt_cache_bytes"] == sum(s.prompt_cache_bytes for s in planned.shards)
            assert await answer(ctl, "kvq4", tokens) == expected
            await ctl.unload("kvq4")
        finally:
            await ctl.close()

    asyncio.run(run())


def test_the_prompt_cache_is_shown_reported_and_never_promised_twice(
    engine_cluster: LocalCluster,
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STUDIOTUI_HOME", str(engine_cluster.home))
    monkeypatch.setenv("COLUMNS", "200")
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(engine_cluster.inventory))
    node = engine_cluster.inventory.names[3]
    where = ["-i", str(inventory), "--nodes", node]

    def cli(*argv: str) -> tuple[int, str]:
        code = main(["place", str(model), *where, *argv])
        out = capsys.readouterr()
        return code, " ".join((out.out + out.err).split())

    # The preview shows the budget per node, in memory and on disk.
    code, said = cli("--prompt-cache", "2", "--prompt-cache-disk", "6", "--dry-run")
    assert code == 0, said
    assert "prompt cache" in said and "on disk" in said and "2.0 GB" in said, said
    assert "6.0 GB" in said, said
    # The longest context each precision holds on the node, as the planner offers it.
    held = re.compile(r"these nodes hold up to (\d+) tokens of context × 1 stream with (\S+) KV")
    code, said = cli("--streams", "1", "--dry-run")
    full = held.search(said)
    assert code == 0 and full and full.group(2) == "full-precision", said
    code, said = cli("--streams", "1", "--kv-bits", "8", "--kv-group-size", "32", "--dry-run")
    kv8 = held.search(said)
    assert code == 0 and kv8 and kv8.group(2) == "8-bit", said
    assert "KV 8-bit (groups of 32)" in said and "decode one at a time" in said, said
    # float32 heads 32 wide: 128 bytes each, 40 at 8 bits; the weights take the same.
    assert int(kv8.group(1)) > 3 * int(full.group(1))
    code, said = cli("--kv-bits", "8", "--dry-run")  # groups of 64 on 32-wide heads
    assert code == REFUSED["shape"] and "--kv-group-size 64 does not divide" in said, said
    assert "use --kv-group-size 32" in said
    # More than the node holds beside the weights and KV: refused with what fits.
    code, said = cli("--prompt-cache", "500", "--dry-run")
    assert code == REFUSED["memory"] and "a prompt cache of 500.0 GB does not fit" in said, said
    assert "or less fits these nodes" in said

    async def run() -> None:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            state = ctl.state.node(node)
            assert state is not None
            room = state.memory_free - node_promised_bytes(state) - RUNNER_OVERHEAD_BYTES
            # A second placement sized to fit the room the first leaves without its cache
            # but not with it.
            cache = int(room * 0.6)
            await ctl.place(model, [node], "first", streams=1, prompt_cache=cache)
            held = ctl.state.node(node)
            assert held is not None
            (shard,) = held.shards
            assert shard.prompt_cache_bytes == cache  # the agent's own report
            assert node_promised_bytes(held) >= shard.kv_bytes + cache
            _, second = ctl.preview(model, [node], 4096, 1, prompt_cache=int(room * 0.5))
            assert isinstance(second, Refusal), second
            _, small = ctl.preview(model, [node], 4096, 1, prompt_cache=int(room * 0.1))
            assert isinstance(small, Plan), small
            # The default budget is what the node can spare now: less than the room.
            _, spare = ctl.preview(model, [node], 4096, 1)
            assert isinstance(spare, Plan)
            assert 0 < spare.shards[0].prompt_cache_bytes <= spare.shards[0].free_after
            await ctl.unload("first")
            await ctl.refresh()
            _, freed = ctl.preview(model, [node], 4096, 1, prompt_cache=int(room * 0.5))
            assert isinstance(freed, Plan), freed
        finally:
            await ctl.close()

    asyncio.run(run())
