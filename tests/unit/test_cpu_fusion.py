"""The CPU-only fused RoPE / RMSNorm / Linear: bit-identical to what they replace.

Greedy tokens of the pipeline must equal mlx-lm's own, so "close" is not enough:
every comparison here is exact.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from worker.cpu_fusion import (
    DecodeCompiledMoE,
    DecodeRMSNorm,
    DecodeRoPE,
    PretransposedLinear,
    angle_table,
    fuse_for_cpu,
    rotate,
)
from worker.shard import load_shard
from worker.shared.demo_model import FAMILIES, HAS_EXPERTS, MOE, DemoSpec, write_demo_model

FUSED = (DecodeRoPE, DecodeRMSNorm, PretransposedLinear)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("dims", "width", "base", "scale", "traditional"),
    [
        (32, 32, 10000.0, 1.0, False),
        (64, 64, 1000000.0, 1.0, True),
        (128, 128, 500000.0, 0.25, False),
        (32, 64, 10000.0, 1.0, False),  # partial rotary: the rest passes through
        (32, 64, 10000.0, 0.5, True),
    ],
)
def test_the_angle_table_rotates_exactly_like_fast_rope(
    dtype: mx.Dtype, dims: int, width: int, base: float, scale: float, traditional: bool
) -> None:
    cos, sin = angle_table(dims, base, scale, 4100, dtype)
    x = mx.random.normal((1, 4, 1, width), key=mx.random.key(dims + width)).astype(dtype)
    for offset in [0, 1, 2, 511, 512, 1023, 4099, *range(3, 4096, 97)]:
        want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
        got = rotate(x, dims, traditional, cos[offset : offset + 1], sin[offset : offset + 1])
        assert mx.array_equal(want, got).item(), f"offset {offset} differs"
    # A verify step's rows: a token and its guesses at consecutive positions.
    many = mx.random.normal((1, 4, 17, width), key=mx.random.key(dims)).astype(dtype)
    for offset in [0, 1, 511, 1000, 4083]:
        for n in (2, 7, 17):
            x = many[:, :, :n]
            want = mx.fast.rope(
                x, dims, traditional=traditional, base=base, scale=scale, offset=offset
            )
            got = rotate(x, dims, traditional, cos[offset : offset + n], sin[offset : offset + n])
            assert mx.array_equal(want, got).item(), f"offset {offset}, {n} rows differ"


def test_decode_rope_matches_and_leaves_other_steps_to_the_original() -> None:
    plain = nn.RoPE(32, base=10000.0)
    fused = DecodeRoPE(plain)
    one = mx.random.normal((1, 8, 1, 32), key=mx.random.key(1))
    many = mx.random.normal((1, 8, 7, 32), key=mx.random.key(2))
    prefill = mx.random.normal((1, 8, 40, 32), key=mx.random.key(2))  # the original's
    for offset in (0, 5, 3000, 4090):  # 3000 is past the first table: it grows
        assert mx.array_equal(fused(prefill, offset=offset), plain(prefill, offset=offset)).item()
        assert mx.array_equal(fused(one, offset=offset), plain(one, offset=offset)).item()
        assert mx.array_equal(fused(many, offset=offset), plain(many, offset=offset)).item()
    per_row = mx.array([4, 9])  # a batch cache's offsets: the original handles them
    two = mx.random.normal((2, 8, 1, 32), key=mx.random.key(3))
    assert mx.array_equal(fused(two, offset=per_row), plain(two, offset=per_row)).item()


def test_decode_norm_and_pretransposed_linear_match_exactly() -> None:
    norm = nn.RMSNorm(64, eps=1e-6)
    norm.weight = mx.random.uniform(0.5, 1.5, (64,), key=mx.random.key(4))
    for shape in [(1, 1, 64), (1, 9, 64), (1, 17, 64), (1, 40, 64), (3, 1, 64), (1, 1, 4, 64)]:
        x = mx.random.normal(shape, key=mx.random.key(5))
        assert mx.array_equal(DecodeRMSNorm(norm)(x), norm(x)).item()
    for bias in (True, False):
        linear = nn.Linear(64, 96, bias=bias)
        for shape in [(1, 1, 64), (1, 13, 64)]:
            x = mx.random.normal(shape, key=mx.random.key(6))
            assert mx.array_equal(PretransposedLinear(linear)(x), linear(x)).item()


@pytest.mark.parametrize(
    ("arch", "quantize"),
    [(arch, None) for arch in FAMILIES] + [("deepseek_v3", "4"), ("gpt_oss", "mxfp4")],
)
def test_a_fused_shard_computes_what_the_plain_one_does(
    tmp_path: Path, arch: str, quantize: str | None
) -> None:
    # float32: unquantized experts multiply only in float32 on MLX's CPU backend.
    dtype = "float32" if quantize is None and arch in MOE else "bfloat16"
    spec = DemoSpec(
        arch=arch, layers=3, hidden=64, heads=4, kv_heads=2, dtype=dtype, quantize=quantize
    )
    model = write_demo_model(tmp_path / arch, spec)
    fused = load_shard(model, 0, 3)  # load_shard fuses (this machine computes on the CPU)
    swapped = [m for m in fused.inner.modules() if isinstance(m, FUSED)]
    # Every family has RMSNorms at least; exact types only, so a family's own RoPE
    # (gpt-oss's YaRN), quantized Linear or latent-attention MultiLinear stay as they are.
    assert swapped, f"nothing was fused in {arch}"
    assert isinstance(fused.inner.norm, DecodeRMSNorm) or type(fused.inner.norm) is not nn.RMSNorm
    plain = load_shard(model, 0, 3, fuse=False)
    caches = fused.make_cache(), plain.make_cache()
    prompt = mx.array([[5, 17, 29, 41, 53, 65, 77, 89, 101, 113]])  # past gpt-oss's window
    token = [None, None]
    for i, shard in enumerate((fused, plain)):
        h = shard.forward(shard.embed(prompt), caches[i])
        token[i] = mx.argmax(shard.logits(h))
    for _ in range(12):  # one-token steps: the fused path
        outs = []
        for i, shard in enumerate((fused, plain)):
            h = shard.forward(shard.embed(token[i].reshape(1, 1)), caches[i])
            outs.append(shard.logits(h))
            token[i] = mx.argmax(outs[-1])
        assert mx.array_equal(outs[0], outs[1]).item(), f"{arch} fused differs"
    # A verify step's width (a token and its guesses): the fused path too.
    guesses = mx.array([[7, 19, 31, 43, 55]])
    outs = [
        shard.logits(shard.forward(shard.embed(guesses), caches[i]))
        for i, shard in enumerate((fused, plain))
    ]
    assert mx.array_equal(outs[0], outs[1]).item(), f"{arch} fused verify step differs"
    compiled = [m for m in fused.inner.modules() if isinstance(m, DecodeCompiledMoE)]
    if arch in HAS_EXPERTS:
        # Every expert block ran compiled (none fell back to the plain one).
        assert compiled and all(m.compiled for m in compiled), arch
    else:
        assert not compiled, arch


def test_a_moe_block_that_cannot_be_traced_runs_as_it_is() -> None:
    from mlx_lm.models.switch_layers import SwitchGLU

    class Routed(nn.Module):
        def __init__(self, reads_a_value: bool) -> None:
            super().__init__()
            self.gate = nn.Linear(16, 4)
            self.switch_mlp = SwitchGLU(16, 32, 4)
            self.reads_a_value = reads_a_value

        def __call__(self, x: mx.array) -> mx.array:
            inds = mx.argpartition(self.gate(x), kth=-2, axis=-1)[..., -2:]
            if self.reads_a_value and inds.max().item() > 9:  # a value read in Python
                return x
            return self.switch_mlp(x, inds).sum(axis=-2)

    one = mx.random.normal((1, 1, 16), key=mx.random.key(7))
    many = mx.random.normal((1, 5, 16), key=mx.random.key(8))
    for reads in (False, True):
        block = Routed(reads)
        want_one, want_many = block(one), block(many)
        holder = nn.Module()
        holder.mlp = block
        assert fuse_for_cpu([holder]) == 2  # the router's Linear, and the block
        assert isinstance(holder.mlp, DecodeCompiledMoE)
        assert mx.array_equal(holder.mlp(one), want_one).item()
        assert mx.array_equal(holder.mlp(many), want_many).item()  # prefill: not compiled
        assert holder.mlp.compiled is not reads  # only the untraceable one fell back
    tensor_rank = nn.Module()
    tensor_rank.mlp = Routed(False)
    fuse_for_cpu([tensor_rank], compile_moe=False)  # a tensor-parallel rank's blocks
    assert type(tensor_rank.mlp) is Routed


def test_fusion_swaps_only_on_the_cpu_and_only_exact_types() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = nn.RoPE(16)
            self.norm = nn.RMSNorm(16)
            self.proj = nn.Linear(16, 16)
            self.quantized = nn.QuantizedLinear(64, 64)
            self.layers = [nn.RMSNorm(16), nn.LayerNorm(16)]

    block = Block()
    assert mx.default_device() == mx.cpu  # the test machine has no Metal
    assert fuse_for_cpu([block]) == 4
    assert isinstance(block.layers[0], DecodeRMSNorm)
    assert type(block.layers[1]) is nn.LayerNorm
    assert type(block.quantized) is nn.QuantizedLinear
