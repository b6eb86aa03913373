"""LoRA adapters placed with their base model: real agents, runners, ZeroMQ and MLX.

The adapter is a real mlx-lm one (tests/support/adapter_model.py: mlx-lm's LoRA layers with
nonzero lora_b); the reference is `mlx_lm.load(model, adapter_path=adapter)`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import openai
import pytest
from mlx_lm.generate import generate_step

from studiotui.api.server import start_server
from studiotui.cli.exits import REFUSED
from studiotui.cli.main import main
from studiotui.cli.status_cmd import status_json
from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller, PlacementError
from studiotui.core.inventory import Inventory, dump_inventory, local_inventory
from studiotui.core.jobs import JobWatch
from studiotui.core.placement import format_bytes
from studiotui.tune import finetune as ft
from tests.support.adapter_model import write_adapter, write_training_text
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.sshd import SshdServer, ssh_node, sshd_server  # noqa: F401 - the fixture
from worker.shared.adapters import base_digest, read_adapter, stamp_identity
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

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


async def unload_all(ctl: Controller) -> None:
    """A test leaves the shared cluster empty, passed or failed."""
    await ctl.refresh()
    for p in ctl.state.placements:
        await ctl.unload(p.name)


async def collect(ctl: Controller, placement: str, tokens: list[int]) -> list[int]:
    out: list[int] = []
    params = {"max_tokens": N, "ignore_eos": True}
    async for msg in ctl.generate(placement, {"tokens": tokens}, params):
        if isinstance(msg, control.Delta):
            out += msg.tokens
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
            for n in (1, 2):
                done = await ctl.place(base, names[:n], prefill_chunk=CHUNK, adapter_dir=adapter)
                placed = ctl.state.placement("tiny+style")
                assert placed is not None
                # Each agent reports its shard's planned share of the adapter (what
                # node_promised_bytes counts while a shard loads), as the plan said.
                out[f"adapter_bytes{n}"] = (
                    {s.node: s.adapter_bytes for s in done.plan.shards},
                    {s.node: s.adapter_bytes for s in placed.shards},
                )
                out[f"label{n}"] = (placed.label, [s.adapter for s in placed.shards])
                out[f"status{n}"] = [
                    (p["name"], p["adapter"]) for p in status_json(ctl)["placements"]
                ]
                out[f"layers{n}"] = placed.layers
                out[f"ranges{n}"] = {s.node: (s.start, s.end) for s in done.plan.shards}
                out[n] = await collect(ctl, "tiny+style", tokens)
                await ctl.unload("tiny+style")
                # Placed again under the same name next round, on the same head node:
                # the old head socket must not linger with its "down since the unload".
                assert not [k for k in ctl.peers if k.startswith("head:tiny+style:")]
        finally:
            await unload_all(ctl)
            await ctl.close()
        return out

    got = asyncio.run(run())
    # (The base placed beside it answers as mlx-lm's base does: the API test below.)
    assert got[1] == want, "adapter over 1 shard diverged from mlx_lm.load(adapter_path=...)"
    assert got[2] == want, f"adapter over 2 shards {got['layers2']} diverged"
    assert got["layers2"] == [[0, 2], [2, 4]]
    share = read_adapter(adapter).bytes_by_layer(4)
    planned, reported = got["adapter_bytes2"]  # type: ignore[misc]
    # Which node is planned first follows the agents' free memory at that moment.
    ranges = got["ranges2"]
    assert sorted(ranges.values()) == [(0, 2), (2, 4)]  # type: ignore[attr-defined]
    expect = {node: sum(share[a:b]) for node, (a, b) in ranges.items()}  # type: ignore[attr-defined]
    assert reported == planned == expect
    assert got["adapter_bytes1"] == ({names[0]: sum(share)},) * 2
    assert got["label2"] == ("tiny + style", ["style", "style"])
    assert got["status2"] == [("tiny+style", "style")]  # `studiotui status --json`


@pytest.mark.parametrize("variant", ["dora", "qlora"])
def test_dora_and_qlora_adapters_over_2_shards_match_mlx_lm(
    adapter_cluster: LocalCluster, made: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """DoRA's layers read their base projection's weight on every call (not calling
    it): the shard's CPU fusion leaves them whole. QLoRA: LoRA over a 4-bit base, whose
    projections are mlx-lm's QuantizedLinear."""
    base = made["base"]
    if variant == "qlora":
        base = write_demo_model(tmp_path / "tiny4", DemoSpec(**{**SPEC.__dict__, "quantize": "4"}))
    adapter = write_adapter(base, tmp_path / variant, num_layers=3, dora=variant == "dora")
    tokens = encode(base)
    want = reference(base, tokens, adapter)
    assert want != reference(base, tokens)
    names = list(adapter_cluster.inventory.names)

    async def run() -> list[int]:
        ctl = adapter_cluster.controller()
        try:
            await ctl.place(base, names, prefill_chunk=CHUNK, adapter_dir=adapter)
            return await collect(ctl, f"{base.name}+{variant}", tokens)
        finally:
            await unload_all(ctl)
            await ctl.close()

    assert asyncio.run(run()) == want


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
    assert base_digest(made["base"])[:12] in refused
    assert base_digest(made["other"])[:12] in refused
    assert placements == []
    assert not any(line.startswith("placing") for line in log), log


def until_eos(model_dir: Path, tokens: list[int]) -> str:
    """The text of `tokens` up to the first end-of-sequence token (where an API answer
    stops), decoded by the model's own tokenizer."""
    _, tok = mlx_lm.load(str(model_dir))
    stop = set(tok.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in stop), len(tokens))
    return str(tok.decode(tokens[:cut]))


def test_fused_model_answers_as_the_placed_adapter_and_the_api_serves_both(
    adapter_cluster: LocalCluster, made: dict[str, Path], tmp_path: Path
) -> None:
    base, adapter = made["base"], made["adapter"]
    fused = tmp_path / "tiny-fused"
    env = {**os.environ, "STUDIOTUI_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    argv = ["fuse", str(base), "--adapter", str(adapter), "--out", str(fused)]
    done = subprocess.run(
        [sys.executable, "-m", "studiotui", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"studiotui place {fused}" in done.stdout
    tokens = encode(base)
    want = reference(base, tokens, adapter)
    # mlx-lm's fuse folded the adapter into the weights: no adapter at load time.
    assert reference(fused, tokens) == want
    names = list(adapter_cluster.inventory.names)

    async def run() -> dict[str, object]:
        ctl = adapter_cluster.controller()
        out: dict[str, object] = {}
        server = None
        try:
            await ctl.start(telemetry=False)
            await ctl.place(fused, names, "fused", prefill_chunk=CHUNK)
            out["fused"] = await collect(ctl, "fused", tokens)
            await ctl.unload("fused")
            await ctl.place(base, names, prefill_chunk=CHUNK, adapter_dir=adapter)
            server = await start_server(ctl, "127.0.0.1", 0)
            client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
            # The base's name never lands on the adapted placement: it answers otherwise.
            try:
                await client.completions.create(model="tiny", prompt=tokens, max_tokens=2)
                out["base alone"] = "answered"
            except openai.NotFoundError as exc:
                out["base alone"] = exc.message
            # Both picked: the base beside the base with the adapter.
            await ctl.place(base, names[:1], prefill_chunk=CHUNK)
            listed = await client.models.list()
            out["ids"] = sorted(m.id for m in listed.data)
            card = await client.models.retrieve("tiny+style")
            out["parent"] = (card.model_extra or {}).get("parent")
            for model in ("tiny", "tiny+style"):
                reply = await client.completions.create(
                    model=model, prompt=tokens, max_tokens=N, temperature=0
                )
                out[model] = (reply.model, reply.choices[0].text)
            await client.close()
        finally:
            if server is not None:
                await server.close()
            await unload_all(ctl)
            await ctl.close()
        return out

    got = asyncio.run(run())
    assert got["fused"] == want, "the fused model over 2 shards diverged from the adapter"
    assert '"tiny" does not exist; ready models: tiny+style' in str(got["base alone"])
    assert got["ids"] == ["tiny", "tiny+style"]
    assert got["parent"] == "tiny"
    assert got["tiny"] == ("tiny", until_eos(base, reference(base, tokens)))
    assert got["tiny+style"] == ("tiny+style", until_eos(base, want))
    assert got["tiny"] != got["tiny+style"]


def test_over_ssh_the_adapter_reaches_only_the_nodes_it_adapts_and_a_mismatch_nothing(
    sshd_server: SshdServer,  # noqa: F811
    made: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Two nodes reached over a real sshd (their agents run here, on its addresses):
    model files and the adapter are copied, as to a Mac across the desk."""
    base = made["base"]
    # The last two layers of four: on an even split, the second shard's only.
    late = write_adapter(base, tmp_path / "late", num_layers=2)
    nodes = tuple(
        ssh_node(sshd_server, a, f"mac-{a[-2:]}", tmp_path / "nodes", 59960)
        for a in sshd_server.addresses[2:4]
    )
    inv = Inventory(name="desk", nodes=nodes)
    home = tmp_path / "home"
    home.mkdir()
    sshd_server.write_known_hosts(home / "known_hosts")
    pids = [local_cluster.start_agent(home, node, inv) for node in nodes]
    tokens = encode(base)

    async def run() -> tuple[list[int], list[list[int]], list[str], str, list[str]]:
        ctl = Controller(home, inv)
        try:
            for _ in range(100):
                await ctl.refresh(timeout=1.0)
                if all(n.state == "up" for n in ctl.state.nodes):
                    break
                await asyncio.sleep(0.2)
            await ctl.place(base, list(inv.names), prefill_chunk=CHUNK, adapter_dir=late)
            placed = ctl.state.placement("tiny+late")
            assert placed is not None
            got = await collect(ctl, "tiny+late", tokens)
            ring = [s.node for s in placed.shards]
            await ctl.unload("tiny+late")
            before = len(ctl.state.log)
            try:
                await ctl.place(made["other"], list(inv.names), adapter_dir=late)
                refused = "placed?!"
            except PlacementError as exc:
                refused = str(exc)
            after = [e.text for e in ctl.state.log[before:]]
            return got, placed.layers, ring, refused, after
        finally:
            await ctl.close()

    try:
        got, layers, ring, refused, log = asyncio.run(run())
    finally:
        for pid in pids:
            local_cluster.kill_pid(pid)
    assert got == reference(base, tokens, late)
    assert layers == [[0, 2], [2, 4]]
    held = {
        node.name: sorted(p.name for p in (Path(node.workdir) / "models").iterdir())
        for node in nodes
    }
    first, second = ring
    assert held[first] == ["tiny"], held  # layers 0-1: no adapted layer, no adapter
    # Layers 2-3: the adapter too, in a folder named by its content.
    folder, model = held[second]
    assert model == "tiny" and folder.startswith("late@"), held
    copied = Path(next(n.workdir for n in nodes if n.name == second)) / "models" / folder
    assert sorted(p.name for p in copied.iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json",
        "adapters.safetensors",
    ]
    assert "not on other" in refused and "trained on tiny" in refused, refused
    assert not any("placing" in line or "copied" in line for line in log), log


def sparse_adapter(base: Path, out: Path, gib: int) -> Path:
    """A LoRA adapter of layer 3's q_proj whose rank makes it `gib` GiB: a real
    safetensors header over a sparse file (nothing is read past the header before the
    planner refuses it, so no disk is spent)."""
    rank = gib * 1024**3 // (2 * 64 * 4)
    shapes = {"lora_a": [64, rank], "lora_b": [rank, 64]}
    header, offset = {}, 0
    for leaf, shape in shapes.items():
        size = shape[0] * shape[1] * 4
        name = f"model.layers.3.self_attn.q_proj.{leaf}"
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    out.mkdir(parents=True)
    with open(out / "adapters.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    config = {"fine_tune_type": "lora", "num_layers": 1}
    config["lora_parameters"] = {"rank": rank, "scale": 4.0, "dropout": 0.0}
    (out / "adapter_config.json").write_text(json.dumps(config))
    stamp_identity(out, base)
    return out


def test_place_counts_the_adapter_on_its_layers_shard_and_refuses_what_does_not_fit(
    adapter_cluster: LocalCluster,
    made: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`place --adapter` on a real cluster: the first check of a base shows its hashing
    in bytes and the second none (cached); the plan counts the adapter on the shard of
    its layers; an adapter the node cannot hold beside the model is refused naming the
    node and the shortfall, before anything is loaded."""
    monkeypatch.setenv("STUDIOTUI_HOME", str(adapter_cluster.home))
    monkeypatch.setenv("COLUMNS", "200")
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(adapter_cluster.inventory))
    fresh = tmp_path / "models" / "fresh"  # the base as just downloaded: nothing cached
    shutil.copytree(made["base"], fresh, ignore=shutil.ignore_patterns(".studiotui-*"))
    huge = sparse_adapter(made["base"], tmp_path / "adapters" / "huge", 12)
    where = ["-i", str(inventory), "--nodes", "local-1"]

    def place(adapter: Path, *more: str) -> tuple[int, str]:
        code = main(["place", str(fresh), "--adapter", str(adapter), *where, *more])
        out = capsys.readouterr()
        return code, " ".join((out.out + out.err).split())

    code, said = place(made["adapter"], "--dry-run")
    assert code == 0, said
    assert "hashing fresh to check the adapter's base (once: cached)" in said, said
    size = sum(p.stat().st_size for p in fresh.iterdir() if not p.name.startswith("."))
    # rich's download column: every byte of the copy, in decimal kB, hashed.
    assert f"{size / 1000:.1f}/{size / 1000:.1f} kB" in said, (size, said)
    # The plan's adapter column: the style adapter's bytes, all on local-1's shard.
    share = sum(read_adapter(made["adapter"]).bytes_by_layer(4))
    assert "adapter" in said and format_bytes(share) in said, said
    code, again = place(made["adapter"], "--dry-run")
    assert code == 0 and "hashing" not in again, again  # the cached hashes answered

    for extra in (("--dry-run",), ()):
        code, said = place(huge, *extra)
        assert code == REFUSED["memory"], said
        assert "fresh fits these nodes without its adapter but not with it" in said, said
        assert "local-1 would hold layers 0–3 and 12.0 GB of adapter tensors" in said, said
        assert re.search(r"\d+\.\d GB more than it has free after the reserve", said), said

    async def direct() -> tuple[str, list[str]]:
        ctl = adapter_cluster.controller()
        try:
            with pytest.raises(PlacementError) as refused:
                await ctl.place(fresh, ["local-1"], adapter_dir=huge)
            await ctl.refresh()
            return str(refused.value), [p.name for p in ctl.state.placements]
        finally:
            await ctl.close()

    said, placed = asyncio.run(direct())
    assert "local-1 would hold layers 0–3 and 12.0 GB of adapter tensors" in said, said
    assert placed == []  # nothing was loaded anywhere


def test_cli_stamps_lists_and_refuses_before_asking_any_node(
    made: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    """`adapter stamp`, `adapter list` and `place --adapter NAME`, in-process; the
    cluster's nodes are never started, so whatever is said comes before any node."""
    home = tmp_path / "home"
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")
    unstamped = write_adapter(made["base"], home / "adapters" / "plain", stamp=False)
    inv = local_inventory(2, base_octet=205, control_port=59940, home=tmp_path / "nodes")
    (tmp_path / "cluster.toml").write_text(dump_inventory(inv))
    cluster = ["-i", str(tmp_path / "cluster.toml")]

    def cli(*argv: str) -> tuple[int, str]:
        code = main([*argv])
        out = capsys.readouterr()
        return code, " ".join((out.out + out.err).split())

    code, said = cli(*cluster, "place", str(made["base"]), "--adapter", "plain", "--dry-run")
    assert code == 2 and "does not say which model it was trained on" in said, said
    assert f"studiotui adapter stamp {unstamped} --model {made['base']}" in said

    code, said = cli("adapter", "stamp", str(unstamped), "--model", str(made["base"]))
    assert code == 0 and f"base tiny (digest {base_digest(made['base'])[:12]})" in said
    code, said = cli("adapter", "list", "tiny")
    assert code == 0 and "plain lora rank 4, layers 2-3 base tiny" in said, said
    # The bare verb lists too (it said "required: adapter_verb", argparse's inner name).
    assert cli("adapter") == cli("adapter", "list")

    # Pipeline stages apply adapters; a tensor-parallel placement is refused, saying so.
    code, said = cli(
        *cluster, "place", str(made["base"]), "--adapter", "plain", "--tensor", "2", "--dry-run"
    )
    assert code == 2 and "not by tensor-parallel groups" in said and "fuse" in said, said
    code, said = cli(*cluster, "place", str(made["other"]), "--adapter", "plain", "--dry-run")
    assert code == 2 and "trained on tiny" in said and "not on other" in said, said
    # Found by name, checked, then the nodes are asked: none is up.
    code, said = cli(*cluster, "place", str(made["base"]), "--adapter", "plain", "--dry-run")
    assert "adapter plain (lora, rank 4, layers 2-3) matches tiny" in said, said
    assert code == 2 and "no node is up" in said, said


def test_an_adapter_a_finetune_job_saved_is_placed_as_is(
    adapter_cluster: LocalCluster, made: dict[str, Path], tmp_path: Path
) -> None:
    """End to end: `studiotui finetune`'s job (mlx-lm's trainer on a node) saves
    jobs/NAME/adapters stamped with the base; placed from there over 2 shards, it is
    named after the job and answers as mlx-lm loads it, unlike the base."""
    base = made["base"]
    data = write_training_text(tmp_path / "data.jsonl", 32)
    names = list(adapter_cluster.inventory.names)
    req = ft.FinetuneRequest(
        str(base), str(data), tuple(names[:1]), "legal", iters=8, batch_size=4,
        learning_rate=1e-2, num_layers=4, save_every=8,
    )  # fmt: skip
    node = adapter_cluster.inventory.nodes[0]
    saved = Path(node.workdir) / "jobs" / "legal" / "adapters"
    tokens = encode(base)

    async def run() -> tuple[str, list[int]]:
        ctl = adapter_cluster.controller()
        try:
            await ctl.start(telemetry=False)
            prepared = ft.prepare(ctl, req, resuming=False)
            record = await ft.launch(ctl, prepared, resume=False)
            end = await ft.attach(ctl, record, JobWatch(record.name, nodes=list(record.nodes)))
            assert end.state == "done", end.message
            await ctl.place(base, names, prefill_chunk=CHUNK, adapter_dir=saved)
            placed = ctl.state.placement("tiny+legal")
            assert placed is not None
            return placed.label, await collect(ctl, "tiny+legal", tokens)
        finally:
            await unload_all(ctl)
            await ctl.close()

    label, got = asyncio.run(run())
    want = reference(base, tokens, saved)
    assert want != reference(base, tokens), "8 steps at 1e-2 must change the greedy answer"
    assert label == "tiny + legal"
    assert got == want
