"""Fewer, fused ops for a decode step on MLX's CPU backend.

On Apple GPUs `mx.fast.rope` and `mx.fast.rms_norm` are single Metal kernels. On
the CPU backend MLX runs their composed fallbacks instead: about a dozen small ops
for each RoPE (two a layer) and six for each norm, and every `nn.Linear` adds a
transpose op. Each op costs the evaluating thread microseconds to encode before
the compute thread may run it, and a pipeline stage cannot hide that cost the way
mlx-lm's loop does (a stage can start encoding only when its input arrives). So
on the CPU a shard swaps, for one-token steps:

- RoPE for a rotation by a precomputed cos/sin table (one row per step, shared by
  every layer), with the two products compiled into fused kernels;
- RMSNorm for a compiled `mx.fast.rms_norm` (element-wise chain fused);
- Linear for one that keeps its weight's transpose.

Measured on the 8-layer bench model: 1121 ops a token become 547, and every output
is bit-identical (tests/unit/test_cpu_fusion.py), so greedy tokens still equal
mlx-lm's. Only steps of at most `FUSED_TOKENS` tokens per sequence take the fused
path (a decode step, a speculative verify step: a token and its guesses): so few
shapes that each compiled function keeps a trace of each, where prefill chunks of
every length would each leave a trace behind.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear

# The most tokens a sequence's step may have to take the fused path: a verify step's
# (worker.speculation.MAX_DRAFT_TOKENS guesses and the token before them).
FUSED_TOKENS = 17


class DecodeRoPE(nn.Module):
    """`nn.RoPE` whose one-token steps read cosines and sines from a table.

    The fallback recomputes the frequencies and the cos/sin of the position in
    every call, twice a layer; a table computed once with the same float32 formula
    gives bit-identical results (checked against `mx.fast.rope` in the tests), and
    a step's row is shared by every layer of the shard.
    """

    def __init__(self, rope: nn.RoPE) -> None:
        super().__init__()
        self.plain = rope

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        n = x.shape[-2]
        if not 1 <= n <= FUSED_TOKENS or not isinstance(offset, int):
            return self.plain(x, offset=offset)
        r = self.plain
        cos, sin = _rows(r.dims, r.base, r.scale, x.dtype, offset, n)
        return rotate(x, r.dims, r.traditional, cos, sin)


def rotate(x: mx.array, dims: int, traditional: bool, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the first `dims` features of `x` by angles whose cos/sin are given,
    in the same order of operations as MLX's RoPE fallback."""
    half = dims // 2
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
    o1, o2 = _turn(x1, x2, cos, sin)
    if traditional:
        out = mx.stack([o1, o2], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        out = mx.concatenate([o1, o2], axis=-1)
    if dims < x.shape[-1]:
        out = mx.concatenate([out, x[..., dims:]], axis=-1)
    return out


@mx.compile
def _turn(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array]:
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def angle_table(
    dims: int, base: float, scale: float, n: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """cos and sin for positions [0, n), computed as the RoPE fallback does."""
    half = dims // 2
    inverse = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
    theta = (mx.arange(n, dtype=mx.float32) * scale)[:, None] * inverse[None, :]
    cos, sin = mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)
    mx.eval(cos, sin)
    return cos, sin


_TableKey = tuple[int, float, float, mx.Dtype]
_tables: dict[_TableKey, tuple[mx.array, mx.array]] = {}
_row_cache: dict[tuple[_TableKey, int, int], tuple[mx.array, mx.array]] = {}


def _rows(
    dims: int, base: float, scale: float, dtype: mx.Dtype, offset: int, n: int = 1
) -> tuple[mx.array, mx.array]:
    key = (dims, base, scale, dtype)
    rows = _row_cache.get((key, offset, n))
    if rows is not None:
        return rows
    table = _tables.get(key)
    if table is None or offset + n > table[0].shape[0]:
        size = max(1024, 1 << (offset + n).bit_length())  # grows by doubling, rarely rebuilt
        table = _tables[key] = angle_table(dims, base, scale, size, dtype)
    cos, sin = table
    if len(_row_cache) > 256:  # rows of steps long past: every request moved on
        _row_cache.clear()
    rows = _row_cache[(key, offset, n)] = (cos[offset : offset + n], sin[offset : offset + n])
    return rows


class DecodeRMSNorm(nn.Module):
    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__()
        self.plain = norm
        eps = norm.eps

        def normalize(x: mx.array, weight: mx.array) -> mx.array:
            return mx.fast.rms_norm(x, weight, eps)

        self._fused = mx.compile(normalize)

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim < 2 or x.shape[1] > FUSED_TOKENS:
            return self.plain(x)
        return self._fused(x, self.plain.weight)


class PretransposedLinear(nn.Module):
    """`nn.Linear` that keeps its weight's transpose (a view: no copy), saving a
    transpose op per projection per step; seven a layer."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.plain = linear
        transposed = linear.weight.T
        mx.eval(transposed)
        if "bias" in linear:
            bias = linear.bias
            self._apply = lambda x: mx.addmm(bias, x, transposed)
        else:
            self._apply = lambda x: x @ transposed

    def __call__(self, x: mx.array) -> mx.array:
        return self._apply(x)


class DecodeCompiledMoE(nn.Module):
    """A mixture-of-experts block (the module holding mlx-lm's `SwitchGLU` or
    `SwitchMLP`: router, top-k, experts, weighting) whose one-token steps run as one
    compiled function of the block's own `__call__`.

    The block is two dozen small ops a layer around its expert products; compiled, its
    element-wise chains run fused (four ops fewer a layer on the 4-bit qwen3_moe) and
    the graph is replayed instead of rebuilt in Python (19 -> 7 us a layer here), which
    shortens the next step's build that a stage runs while a step computes. Outputs are
    bit-identical (tests/unit/test_cpu_fusion.py; the family matrix compares tokens with
    mlx-lm). A block that cannot be traced (it reads an array's value in Python) keeps
    running as it is."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.plain = block
        self._compiled: Any = mx.compile(block.__call__)

    @property
    def compiled(self) -> bool:
        """Whether one-token steps still take the compiled path (False once a trace failed)."""
        return self._compiled is not None

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None or args or kwargs or x.ndim != 3 or x.shape[1] != 1:
            return self.plain(x, *args, **kwargs)
        try:
            return self._compiled(x)
        except Exception:  # not traceable: the block as mlx-lm wrote it, from now on
            self._compiled = None
            return self.plain(x)


def fuse_for_cpu(modules: list[nn.Module], *, compile_moe: bool = True) -> int:
    """Swap every plain `nn.RoPE` and `nn.RMSNorm` under `modules` for its decode-fused
    twin, and (with `compile_moe`) wrap every mixture-of-experts block in
    `DecodeCompiledMoE`, when MLX computes on the CPU. Returns how many were swapped.
    A tensor-parallel rank passes `compile_moe=False`: its blocks sum over the group
    inside (`all_sum`), which stays outside a compiled function."""
    if mx.default_device() != mx.cpu:
        return 0
    return sum(_swap(module, compile_moe) for module in modules)


_FUSED: dict[type, type[nn.Module]] = {
    nn.RoPE: DecodeRoPE,
    nn.RMSNorm: DecodeRMSNorm,
    nn.Linear: PretransposedLinear,
}


def _swap(module: nn.Module, compile_moe: bool) -> int:
    swapped = 0
    for name, child in list(module.items()):
        if isinstance(child, list):
            for i, item in enumerate(child):
                child[i], n = _fused(item, compile_moe)
                swapped += n
        else:
            module[name], n = _fused(child, compile_moe)
            swapped += n
    return swapped


# Modules that read their child layer's weight instead of calling it (mlx-lm's DoRA
# layers norm `self.linear.weight` on every call): their children stay as they are.
_READS_CHILD_WEIGHTS = (DoRALinear, DoRAEmbedding)


def _fused(child: Any, compile_moe: bool) -> tuple[Any, int]:
    """`child` swapped for its fused twin (exact types only: a subclass may compute
    differently), or with its own children swapped (and compiled, if it is a
    mixture-of-experts block)."""
    if isinstance(child, _READS_CHILD_WEIGHTS):
        return child, 0
    twin = _FUSED.get(type(child))
    if twin is not None:
        return twin(child), 1  # type: ignore[call-arg]
    if isinstance(child, nn.Module):
        swapped = _swap(child, compile_moe)
        if compile_moe and _is_moe_block(child):
            return DecodeCompiledMoE(child), swapped + 1
        return child, swapped
    return child, 0


def _is_moe_block(module: nn.Module) -> bool:
    """A module that routes to experts: one of its own children is mlx-lm's switch layer."""
    return any(isinstance(child, SwitchGLU | SwitchMLP) for child in module.values())
