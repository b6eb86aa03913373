"""Every family a shard runs, split into 1, 2 and 3 shards, token for token against mlx-lm.

The matrix runs in-process: real shards (mlx-lm's own model classes, loaded from
demo directories that `mlx_lm.load` loads unchanged) driven by real `Stage`s whose
frames pass through a work queue instead of ZeroMQ, as in tests/test_stage.py.
Every frame still crosses as bytes. A subset goes through real agents and runner
processes at the end of the file.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from tests.support.cluster_fixture import LocalCluster
from tests.support.ring_harness import CHUNK, InProcessRing
from worker.shard import ShardLoadError, load_shard
from worker.shared.demo_model import FAMILIES, DemoSpec, write_demo_model
from worker.shared.model_support import FAMILIES as SUPPORTED
from worker.shared.model_support import unsupported_reason
from worker.shared.protocol import control

LAYERS = 5
N_TOKENS = 12
PROMPT = list(range(40, 62))  # 22 tokens: three prefill chunks, past the 8-token windows
SPLITS = {1: [(0, 5)], 2: [(0, 2), (2, 5)], 3: [(0, 1), (1, 4), (4, 5)]}
# The 3-shard split runs on a subset: one of each kind of attention and cache.
THREE_SHARDS = ("deepseek_v3", "deepseek_v32", "gpt_oss", "qwen3_next", "gemma3_text", "llama")


def spec(arch: str, quantize: str | None = None, **kw: Any) -> DemoSpec:
    base: dict[str, Any] = {"layers": LAYERS, "hidden": 64, "heads": 4, "kv_heads": 2}
    return DemoSpec(arch=arch, dtype="float32", seed=11, quantize=quantize, **{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("families")
    made: dict[str, Path] = {}

    def get(arch: str, quantize: str | None = None, **kw: Any) -> Path:
        key = "-".join([arch, str(quantize), *(f"{k}{v}" for k, v in sorted(kw.items()))])
        if key not in made:
            made[key] = write_demo_model(root / key, spec(arch, quantize, **kw))
        return made[key]

    return get


def reference(model: Path, n: int = N_TOKENS, sampler: Any = None) -> list[int]:
    loaded, _ = mlx_lm.load(str(model))
    steps = generate_step(
        mx.array(PROMPT), loaded, max_tokens=n, prefill_step_size=CHUNK, sampler=sampler
    )
    return [int(tok) for tok, _ in steps]


class Ring(InProcessRing):
    """N stages of one placement in one process; frames go through a work queue as bytes."""

    def submit(self, rid: str, params: dict[str, Any], tokens: list[int] = PROMPT) -> None:
        self.stages[0].submit(b"c", {"rid": rid, "params": params, "tokens": tokens})

    def answer(self, params: dict[str, Any], rid: str = "r") -> list[int]:
        self.submit(rid, params)
        self.drain()
        return self.tokens(rid)

    def held(self) -> list[int]:
        """Per-request state each stage still keeps."""
        return [len(s.caches) + len(s.prebuilt) + len(s.tail_requests) for s in self.stages]


GREEDY = {"max_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_tokens": N_TOKENS, "temperature": 1.5, "top_p": 0.98, "seed": 5, "ignore_eos": True}


# model_types real checkpoints ship with that mlx-lm maps onto a demo family's class.
ALIASES = {"kimi_k2": "deepseek_v3", "minimax_m2": "minimax"}


def test_every_demo_family_is_in_the_support_table() -> None:
    assert set(FAMILIES) | set(ALIASES) == set(SUPPORTED)


@pytest.mark.parametrize(("alias", "arch"), sorted(ALIASES.items()))
def test_a_family_under_the_name_it_ships_with_runs(
    models: Callable[..., Path], tmp_path: Path, alias: str, arch: str
) -> None:
    source = models(arch)
    model = tmp_path / alias
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = alias
    (model / "config.json").write_text(json.dumps(config))
    assert unsupported_reason(config) is None
    assert Ring(model, SPLITS[2]).answer(GREEDY) == reference(source)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_family_split_into_shards_matches_mlx_lm(models: Callable[..., Path], arch: str) -> None:
    model = models(arch)
    assert unsupported_reason(mlx_lm.utils.load_config(model)) is None
    expected = reference(model)
    counts = (1, 2, 3) if arch in THREE_SHARDS else (1, 2)
    sampled: dict[int, list[int]] = {}
    for n in counts:
        ring = Ring(model, SPLITS[n])
        assert ring.answer(GREEDY) == expected, f"{arch} over {n} shards diverged"
        sampled[n] = ring.answer(SAMPLED, rid="s")
        assert ring.held() == [0] * n
    # Seeded sampling gives the same tokens whatever the split.
    assert len({tuple(s) for s in sampled.values()}) == 1, sampled


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_4bit_family_split_into_shards_matches_mlx_lm(
    models: Callable[..., Path], arch: str
) -> None:
    model = models(arch, "4")
    config = mlx_lm.utils.load_config(model)
    assert config["quantization"]["bits"] == 4
    expected = reference(model)
    for n in (1, 2):
        assert Ring(model, SPLITS[n]).answer(GREEDY) == expected, f"4-bit {arch}, {n} shards"


@pytest.mark.parametrize(
    ("quantize", "group"),
    [
        ("8", None),
        ("4", 32),
        ("4", 128),
        ("mixed", None),
        ("mxfp4", None),
        ("mxfp8", None),
        ("nvfp4", None),
    ],
)
def test_every_quantization_runs_split(
    models: Callable[..., Path], quantize: str, group: int | None
) -> None:
    arch = "gpt_oss" if quantize == "mxfp4" else "qwen3_moe"  # gpt-oss ships in mxfp4
    # A group of 128 needs rows of 128: the demo is twice as wide then.
    kw = {"group_size": group, "hidden": max(64, group)} if group else {}
    model = models(arch, quantize, **kw)
    quant = mlx_lm.utils.load_config(model)["quantization"]
    assert unsupported_reason(mlx_lm.utils.load_config(model)) is None
    if quantize == "mixed":
        # Per-module overrides, as mlx-lm's mixed_4_6 recipe writes them.
        assert {q["bits"] for q in quant.values() if isinstance(q, dict)} == {4, 6}
    else:
        assert quant["mode"] == ("affine" if quantize in "48" else quantize)
    assert Ring(model, SPLITS[3]).answer(GREEDY) == reference(model)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_concurrent_requests_match_alone_and_cancel_frees_every_cache(
    models: Callable[..., Path], arch: str
) -> None:
    model = models(arch)
    ring = Ring(model, SPLITS[2])
    prompts = [PROMPT[: 10 + 4 * i] for i in range(3)]
    params = [{**SAMPLED, "seed": i} for i in range(3)]
    alone = []
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        ring.submit(f"alone{i}", q, p)
        ring.drain()
        alone.append(ring.tokens(f"alone{i}"))
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        ring.submit(f"together{i}", q, p)
    ring.drain()
    assert [ring.tokens(f"together{i}") for i in range(3)] == alone
    assert len({tuple(a) for a in alone}) == 3

    ring.submit("cancelled", {**GREEDY, "max_tokens": 500})
    ring.drain(steps=20)
    assert all(ring.held()), "the request should be in flight on every shard"
    ring.stages[0].cancel("cancelled")
    ring.drain()
    assert ring.held() == [0, 0]


# ---- through real agents and runner processes ------------------------------------------


async def _collect(ctl: Any, placement: str, n: int) -> list[int]:
    out: list[int] = []
    params = {"max_tokens": n, "ignore_eos": True}
    async for msg in ctl.generate(placement, {"tokens": PROMPT}, params):
        if isinstance(msg, control.Delta):
            out += msg.tokens
    return out


@pytest.mark.parametrize(
    ("arch", "quantize", "nodes"),
    [
        ("deepseek_v3", None, 3),
        ("qwen3_moe", "4", 2),
        ("qwen3_next", "mxfp4", 3),
        ("gpt_oss", "mxfp4", 2),
        ("kimi_k25", "4", 2),
    ],
)
def test_real_agents_run_moe_and_hybrid_families(
    engine_cluster: LocalCluster,
    models: Callable[..., Path],
    arch: str,
    quantize: str | None,
    nodes: int,
) -> None:
    model = models(arch, quantize)
    expected = reference(model, 16)

    async def run() -> list[int]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            names = list(engine_cluster.inventory.names)[:nodes]
            await ctl.place(model, names, arch, prefill_chunk=CHUNK)
            assert len(ctl.state.placement(arch).shards) == nodes
            got = await _collect(ctl, arch, 16)
            await ctl.unload(arch)
            return got
        finally:
            await ctl.close()

    assert asyncio.run(run()) == expected, f"{arch} ({quantize}) over {nodes} nodes diverged"


def test_unquantized_half_precision_experts_are_refused_on_the_cpu(tmp_path: Path) -> None:
    # MLX's CPU gather_mm multiplies float32 only: the shard says so before reading weights,
    # rather than failing at the first token. Quantized experts run in any dtype.
    model = write_demo_model(
        tmp_path / "bf16", DemoSpec(arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2)
    )
    with pytest.raises(ShardLoadError, match=r"unquantized bfloat16 experts.*float32"):
        load_shard(model, 0, 2)
    quantized = write_demo_model(
        tmp_path / "q",
        DemoSpec(arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2, quantize="4"),
    )
    assert Ring(quantized, [(0, 1), (1, 2)]).answer(GREEDY) == reference(quantized)


def test_gpt_oss_as_it_ships_its_quantization_config_runs(
    models: Callable[..., Path], tmp_path: Path
) -> None:
    # gpt-oss's config.json names only {"quant_method": "mxfp4"}; mlx-lm works out the
    # modes from the tensors. Same weights, that config: the same tokens, split.
    source = models("gpt_oss", "mxfp4")
    model = tmp_path / "gpt-oss"
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("quantization")
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model / "config.json").write_text(json.dumps(config))
    assert unsupported_reason(config) is None
    assert Ring(model, SPLITS[2]).answer(GREEDY) == reference(source)


def _config(**quant: Any) -> dict[str, Any]:
    return {"model_type": "qwen3_moe", "quantization": quant}


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"model_type": "deepseek_v3"}, None),
        ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}, None),
        ({"model_type": "bert"}, "model family 'bert' is not supported"),
        (_config(bits=4, group_size=64, mode="affine"), None),
        (_config(bits=4, group_size=32, mode="mxfp4"), None),
        (_config(bits=4, group_size=16, mode="nvfp4"), None),
        (_config(bits=8, group_size=32, mode="mxfp8"), None),
        (_config(bits=4, group_size=64, mode="mxfp4"), "mxfp4 is group size 32, 4 bits"),
        (_config(bits=7, group_size=64), "7-bit affine quantization is not supported"),
        (_config(bits=4, group_size=48), "group size 48 is not supported"),
        (_config(bits=4, group_size=64, mode="fp3"), "quantization mode 'fp3' is not"),
        (
            _config(
                bits=4, group_size=64, **{"model.layers.0.mlp.gate": {"bits": 9, "group_size": 64}}
            ),
            "9-bit affine quantization for model.layers.0.mlp.gate is not supported",
        ),
        (
            _config(
                bits=4,
                group_size=64,
                **{"lm_head": {"bits": 6, "group_size": 64}, "model.embed_tokens": False},
            ),
            None,
        ),
        (
            {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}},
            None,
        ),
        (
            {"model_type": "gpt_oss", "quantization_config": {"quant_method": "awq2"}},
            "quantization method 'awq2' is not supported",
        ),
    ],
)
def test_the_support_table_names_what_it_refuses(
    config: dict[str, Any], reason: str | None
) -> None:
    got = unsupported_reason(config)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k25", "qwen3_next"])
def test_shards_run_from_directories_holding_only_their_files(tmp_path: Path, arch: str) -> None:
    # As on SSH nodes: each shard's directory holds the small files and the safetensors
    # files of its own layers (the model is split over 5 files by layer), nothing else.
    from studiotui.cluster.model_files import needed_files

    model = write_demo_model(tmp_path / "whole", spec(arch, "4", files=LAYERS))
    ranges = SPLITS[3]
    parts = []
    for i, (a, b) in enumerate(ranges):
        part = tmp_path / f"part{i}"
        part.mkdir()
        for f in needed_files(model, a, b, LAYERS):
            shutil.copy(model / f.name, part / f.name)
        parts.append(part)
    assert all(len(list(p.glob("model-*.safetensors"))) < LAYERS for p in parts)
    ring = Ring.from_parts(parts, ranges)
    assert ring.answer(GREEDY) == reference(model)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_next", "gemma3_text"])
def test_tied_embeddings_serve_as_the_head_on_the_last_shard(
    models: Callable[..., Path], arch: str
) -> None:
    model = models(arch, tie_embeddings=True)
    assert "lm_head.weight" not in mx.load(str(model / "model.safetensors"))
    expected = reference(model)
    for n in (2, 3):
        ring = Ring(model, SPLITS[n])
        # The last shard reads the embedding (its head); a middle one does not.
        owned = [" ".join(stage.shard.owned) for stage in ring.stages]
        assert "embed_tokens" in owned[0] and "embed_tokens" in owned[-1]
        assert all("embed_tokens" not in o for o in owned[1:-1])
        assert ring.answer(GREEDY) == expected, f"tied {arch} over {n} shards"


def _hugging_face_layout(mlx_dir: Path, out: Path) -> Path:
    """The same qwen3_moe weights as the original checkpoints lay them out: one tensor per
    expert, split over one file per layer with an index. mlx-lm's sanitize stacks them."""
    out.mkdir()
    for f in mlx_dir.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    weights = mx.load(str(mlx_dir / "model.safetensors"))
    files: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        parts = key.split(".")
        layer = parts[2] if key.startswith("model.layers.") else "rest"
        group = files.setdefault(f"model-{layer}.safetensors", {})
        if ".switch_mlp." in key:
            for e in range(value.shape[0]):
                group[key.replace(".switch_mlp.", f".experts.{e}.")] = value[e]
        else:
            group[key] = value
    for name, group in files.items():
        mx.save_safetensors(str(out / name), group)
    weight_map = {k: name for name, group in files.items() for k in group}
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_a_download_in_hugging_face_layout_runs_from_partial_directories(
    models: Callable[..., Path], tmp_path: Path
) -> None:
    from studiotui.cluster.model_files import needed_files

    source = models("qwen3_moe")
    model = _hugging_face_layout(source, tmp_path / "hf")
    ranges = SPLITS[2]
    parts = []
    for i, (a, b) in enumerate(ranges):
        parts.append(tmp_path / f"part{i}")
        parts[-1].mkdir()
        for f in needed_files(model, a, b, LAYERS):
            shutil.copy(model / f.name, parts[-1] / f.name)
    # The experts' names in the files are not the module's: the shard checks what it
    # owns under the names mlx-lm's sanitize gives them.
    assert Ring.from_parts(parts, ranges).answer(GREEDY) == reference(source)
    shutil.rmtree(parts[1])
    parts[1].mkdir()
    for f in needed_files(model, 0, 2, LAYERS):  # the wrong shard's files
        shutil.copy(model / f.name, parts[1] / f.name)
    with pytest.raises(ShardLoadError, match=r"lacks model\.layers\.2\."):
        load_shard(parts[1], 2, 5)


def test_a_placement_of_experts_the_cpu_cannot_run_fails_with_the_reason(
    engine_cluster: LocalCluster, tmp_path: Path
) -> None:
    from studiotui.cluster.controller import PlacementError

    model = write_demo_model(
        tmp_path / "bf16-moe",
        DemoSpec(arch="deepseek_v3", layers=3, hidden=64, heads=4, kv_heads=2),
    )

    async def run() -> tuple[str, list[str]]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            try:
                await ctl.place(model, list(engine_cluster.inventory.names)[:2], "bf16-moe")
                error = "placed?!"
            except PlacementError as exc:
                error = str(exc)
            await ctl.refresh()
            return error, [p.name for p in ctl.state.placements]
        finally:
            await ctl.close()

    error, left = asyncio.run(run())
    assert "unquantized bfloat16 experts" in error and "quantized" in error, error
    assert "bf16-moe" not in left


def test_decoder_config_finds_a_nested_decoder() -> None:
    from worker.shared.model_support import decoder_config

    kimi = {
        "model_type": "kimi_k25",
        "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61},
    }
    merged = decoder_config(kimi)
    assert merged["num_hidden_layers"] == 61 and merged["model_type"] == "kimi_k25"
    assert decoder_config({"model_type": "llama", "num_hidden_layers": 8}) == {
        "model_type": "llama",
        "num_hidden_layers": 8,
    }


@pytest.mark.parametrize("nodes", [2, 3])
def test_float32_prompts_of_several_full_chunks_cross_real_sockets(
    engine_cluster: LocalCluster, tmp_path: Path, nodes: int
) -> None:
    """A float32 prefill chunk of 512 tokens fills the ring's frame limit exactly; the
    CURVE box around it must still fit (it did not: the frame was refused by ZeroMQ and
    the next stage never heard of the request)."""
    model = write_demo_model(
        tmp_path / "f32",
        DemoSpec(arch="llama", layers=6, hidden=128, heads=4, kv_heads=2, dtype="float32", seed=5),
    )
    prompt = [(7 * i) % 200 + 3 for i in range(1100)]  # two full chunks of 512 and a tail
    loaded, _ = mlx_lm.load(str(model))
    expected = [
        int(t)
        for t, _ in generate_step(mx.array(prompt), loaded, max_tokens=8, prefill_step_size=512)
    ]

    async def run() -> list[int]:
        ctl = engine_cluster.controller()
        try:
            await ctl.refresh()
            names = list(engine_cluster.inventory.names)[:nodes]
            await ctl.place(model, names, "f32", context_tokens=2048)
            out: list[int] = []
            try:
                params = {"max_tokens": 8, "ignore_eos": True}
                async for msg in ctl.generate("f32", {"tokens": prompt}, params):
                    assert isinstance(msg, control.Accepted | control.Delta | control.Done), msg
                    if isinstance(msg, control.Delta):
                        out += msg.tokens
            finally:
                await ctl.unload("f32")
            return out
        finally:
            await ctl.close()

    assert asyncio.run(run()) == expected
