"""The seeds' clusters on paper: the real models planned on the real machines.

Two articles set the bar: 2 × 512 GB + 2 × 256 GB M3 Ultra Mac Studios, and
4 × 512 GB. The models are header-only copies of DeepSeek-V3.1 / R1, Kimi-K2,
Qwen3-235B-A22B, GLM-4.6 and gpt-oss-120b at their usual quantizations
(tests/support/seed_models.py), read by the same `read_model` a real download goes through.
"""

from __future__ import annotations

import re

import pytest

from studiotui.core.model_facts import ModelInfo, read_model, safetensors_tensors
from studiotui.core.placement import NodeBudget, Plan, Refusal, plan
from tests.support.seed_models import renamed, seed_model

GiB = 1024**3
CONTEXT = 32_768  # a long conversation, as the articles ran


def mac(name: str, memory_gb: int) -> NodeBudget:
    """A Mac Studio at rest: macOS and its apps hold ~8 GB of its unified memory."""
    return NodeBudget(name, memory_gb * GiB - 8 * GiB, memory_gb * GiB)


MIXED = [
    mac("ultra-512a", 512),
    mac("ultra-512b", 512),
    mac("ultra-256a", 256),
    mac("ultra-256b", 256),
]
FOUR = [mac(f"studio-{i}", 512) for i in range(1, 5)]


@pytest.fixture(scope="session")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInfo]:
    """Every seed model, written once per session (header-only: a few MB of disk)."""
    root = tmp_path_factory.mktemp("seeds")
    dirs = {
        f"{name}-{quant}": seed_model(root, name, quant)
        for name, quant in [
            ("deepseek-v3.1", "8bit"),
            ("deepseek-v3.1", "4bit"),
            ("kimi-k2", "8bit"),
            ("kimi-k2", "4bit"),
            ("qwen3-235b-a22b", "8bit"),
            ("qwen3-235b-a22b", "4bit"),
            ("glm-4.6", "8bit"),
            ("glm-4.6", "4bit"),
            ("gpt-oss-120b", "mxfp4"),
        ]
    }
    dirs["deepseek-r1-8bit"] = renamed(dirs["deepseek-v3.1-8bit"], "deepseek-r1-8bit")
    return {key: read_model(path) for key, path in dirs.items()}


def _plan(info: ModelInfo, nodes: list[NodeBudget]) -> Plan | Refusal:
    return plan(info.facts, nodes, context_tokens=CONTEXT)


def _gb(text: str, label: str) -> float:
    found = re.search(rf"{label} (\d+(?:\.\d+)?) GB", text)
    assert found, f"no '{label} … GB' in: {text}"
    return float(found.group(1))


def test_the_copies_read_like_downloads(seeds: dict[str, ModelInfo]) -> None:
    ds = seeds["deepseek-v3.1-8bit"]
    files = sorted(ds.path.glob("*.safetensors"))
    # Sparse: the files have their real length and hold next to nothing on disk.
    assert ds.disk_bytes > 650 * GiB and len(files) > 100
    assert sum(f.stat().st_blocks * 512 for f in files) < 64 * 1024**2
    assert ds.family == "deepseek_v3" and ds.n_layers == 61 and ds.quantization == "8-bit"
    # Parameters as published: 671B (the MTP layer is not part of an mlx-lm model);
    # 8-bit weights with bfloat16 scales and biases are 8.5 bits per weight.
    weights = ds.facts.weight_bytes
    assert 640 * GiB < weights < 680 * GiB, weights / GiB  # "~700 GB" in decimal units
    assert 0.5 < seeds["deepseek-v3.1-4bit"].facts.weight_bytes / weights < 0.6
    assert 1000 * GiB < seeds["kimi-k2-8bit"].facts.weight_bytes < 1050 * GiB
    assert 220 * GiB < seeds["qwen3-235b-a22b-8bit"].facts.weight_bytes < 240 * GiB
    assert 330 * GiB < seeds["glm-4.6-8bit"].facts.weight_bytes < 360 * GiB
    assert 55 * GiB < seeds["gpt-oss-120b-mxfp4"].facts.weight_bytes < 65 * GiB


def test_layer_bytes_include_experts_and_follow_the_headers(seeds: dict[str, ModelInfo]) -> None:
    ds = seeds["deepseek-v3.1-8bit"]
    layers = ds.facts.layer_bytes
    # Three dense layers, then 58 MoE layers of 256 experts (switch_mlp) each.
    assert max(layers[:3]) * 10 < min(layers[3:])
    assert len(set(layers[3:])) == 1 and len(set(layers[:3])) == 1
    # Exactly the bytes the headers give for layer 10, scales and biases included.
    tensors = {}
    for file in ds.path.glob("*.safetensors"):
        tensors.update(safetensors_tensors(file))
    layer10 = {k: t for k, t in tensors.items() if k.startswith("model.layers.10.")}
    assert any(".switch_mlp." in k and k.endswith(".scales") for k in layer10)
    assert layers[10] == sum(t.nbytes for t in layer10.values())


def test_caches_are_sized_per_family(seeds: dict[str, ModelInfo]) -> None:
    ds = seeds["deepseek-v3.1-8bit"].facts
    # MLA: one 512 + 64 latent per token per layer, in bfloat16.
    assert ds.kv_bytes(1) == [(512 + 64) * 2] * 61
    assert sum(ds.kv_bytes(CONTEXT)) < 2.2 * GiB  # 2 × 128 heads × 192 would be 366 GB
    oss = seeds["gpt-oss-120b-mxfp4"].facts
    sliding, full = oss.kv_bytes(CONTEXT)[0], oss.kv_bytes(CONTEXT)[1]
    assert sliding == 128 * 2 * 8 * 64 * 2 and full == CONTEXT * 2 * 8 * 64 * 2
    qwen = seeds["qwen3-235b-a22b-4bit"].facts
    assert qwen.kv_bytes(1) == [2 * 4 * 128 * 2] * 94


def test_deepseek_8bit_fits_on_the_two_512_gb_nodes_and_not_the_two_256_gb_ones(
    seeds: dict[str, ModelInfo],
) -> None:
    ds = seeds["deepseek-v3.1-8bit"]
    big = _plan(ds, MIXED[:2])
    assert isinstance(big, Plan), big
    assert sorted(s.node for s in big.shards) == ["ultra-512a", "ultra-512b"]
    assert all(s.free_after > 0 for s in big.shards)
    # The split follows bytes: the shard with the light dense layers takes more layers,
    # and the two shards' weights differ by less than one MoE layer.
    first, second = big.shards
    assert first.end - first.start > second.end - second.start
    assert abs(first.weight_bytes - second.weight_bytes) < ds.facts.layer_bytes[10]

    small = _plan(ds, MIXED[2:])
    assert isinstance(small, Refusal)
    need, free = _gb(small.reason, "needs"), _gb(small.reason, "has")
    short = _gb(small.reason, "at least")
    print(small.reason)
    assert need > 650 and free < 500
    assert short == pytest.approx(need - free, abs=0.2)  # the shortfall, stated

    # All four of the mixed cluster hold it too, with the 512 GB nodes taking more.
    every = _plan(ds, MIXED)
    assert isinstance(every, Plan), every
    held = {s.node: s.weight_bytes for s in every.shards}
    assert held["ultra-512a"] > held["ultra-256a"] and held["ultra-512b"] > held["ultra-256b"]


def test_deepseek_v3_and_r1_at_8_bit_both_fit_on_four_512_gb_nodes_at_once(
    seeds: dict[str, ModelInfo],
) -> None:
    v3, r1 = seeds["deepseek-v3.1-8bit"], seeds["deepseek-r1-8bit"]
    first = _plan(v3, FOUR[:2])
    assert isinstance(first, Plan), first
    taken = {s.node: s.weight_bytes + s.kv_bytes for s in first.shards}
    after = [NodeBudget(n.name, n.free_bytes - taken.get(n.name, 0), n.total_bytes) for n in FOUR]
    second = _plan(r1, after[2:])
    assert isinstance(second, Plan), second
    assert {s.node for s in second.shards} == {"studio-3", "studio-4"}
    # …and not on the pair V3 already fills.
    assert isinstance(_plan(r1, after[:2]), Refusal)


def test_qwen3_235b_fits_on_one_512_gb_node_at_4_and_8_bit(seeds: dict[str, ModelInfo]) -> None:
    for quant in ("4bit", "8bit"):
        one = _plan(seeds[f"qwen3-235b-a22b-{quant}"], FOUR[:1])
        assert isinstance(one, Plan), (quant, one)
        assert len(one.shards) == 1 and one.shards[0].free_after > 0


def test_kimi_glm_and_gpt_oss_on_the_seed_machines(seeds: dict[str, ModelInfo]) -> None:
    # Kimi K2 (1T): 8-bit needs all four 512 GB nodes; 4-bit fits the two of them.
    assert isinstance(_plan(seeds["kimi-k2-8bit"], FOUR), Plan)
    assert isinstance(_plan(seeds["kimi-k2-8bit"], FOUR[:2]), Refusal)
    assert isinstance(_plan(seeds["kimi-k2-4bit"], FOUR[:2]), Plan)
    # GLM-4.6 (355B): 8-bit on one 512 GB node, 4-bit on one 256 GB node.
    assert isinstance(_plan(seeds["glm-4.6-8bit"], FOUR[:1]), Plan)
    assert isinstance(_plan(seeds["glm-4.6-4bit"], MIXED[2:3]), Plan)
    assert isinstance(_plan(seeds["glm-4.6-8bit"], MIXED[2:3]), Refusal)
    # gpt-oss-120b as it ships (mxfp4): one 256 GB node, with room to spare.
    oss = _plan(seeds["gpt-oss-120b-mxfp4"], MIXED[2:3])
    assert isinstance(oss, Plan) and oss.shards[0].free_after > 150 * GiB


def test_each_node_is_sent_only_the_files_of_its_share(seeds: dict[str, ModelInfo]) -> None:
    from studiotui.cluster.model_files import needed_files

    ds = seeds["deepseek-v3.1-8bit"]
    result = _plan(ds, MIXED[:2])
    assert isinstance(result, Plan)
    for shard in result.shards:
        sent = sum(f.size for f in needed_files(ds.path, shard.start, shard.end, ds.n_layers))
        # Its own layers, plus at most the 5 GB file it shares with its neighbour.
        assert shard.weight_bytes <= sent < shard.weight_bytes + 6 * GiB
