"""What one node's own device does, measured with MLX: matrix-multiply throughput per
dtype and memory bandwidth; and the rank program of the group's distributed product.

The agent runs this in a process of its own (`python -m worker.device_bench SIZES`), so a
measurement that takes seconds never blocks the agent's loop and a crash (an MLX abort,
the OOM killer) ends this process, not the agent. It prints one JSON object a line: a
`step` as each figure starts, then `figures` (or `fatal`). Given a job's spec file
(`python -m worker.device_bench SPEC.json`, the `benchmark` kind of worker.jobs) it is
one rank of an `mx.distributed` group multiplying a matrix whose inner dimension is
split over the ranks, summed with `all_sum`.

Each figure is timed on the node's default device (the GPU on a Mac, the CPU here) for
about `seconds` after one warm-up, and is the work over the median time of one
repetition. Matrices are sized to the device: a quick probe at `PROBE_N` tells how long
a product takes, and the largest power of two up to `matmul_n` that keeps a repetition
near `seconds / TARGET_REPS` is used (a slow kernel, such as a CPU's bfloat16 product,
gets a smaller matrix instead of a minute-long run).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx

from worker import jobs
from worker.group import BACKENDS, GroupError, join
from worker.shared.protocol.limits import DEVICE_BENCH_BOUNDS, GROUP_BENCH_BOUNDS, out_of_bounds

DTYPES = ("float32", "bfloat16", "float16")
PROBE_N = 128
MIN_N = int(DEVICE_BENCH_BOUNDS["matmul_n"][0])
TARGET_REPS = 5
MIN_REPS = 3
COPY_ELEMENT_BYTES = 4  # float32
ALLREDUCE_WIDTH = 4096  # a decode step's activation of a large model, bfloat16
ALLREDUCE_REPS = 20


class SpecError(ValueError):
    """A measurement asked with sizes this program will not run."""


def matmul_flops(m: int, k: int, n: int) -> float:
    """Floating-point operations of an (m x k) @ (k x n) product: a multiply and an add
    per term."""
    return 2.0 * m * k * n


def rate(amount: float, seconds: Sequence[float]) -> float:
    """`amount` of work per second, over the median time of one repetition."""
    if not seconds:
        raise ValueError("no timed repetition")
    middle = statistics.median(seconds)
    return amount / middle if middle > 0 else math.inf


def pick_n(probe_s: float, probe_n: int, max_n: int, budget_s: float) -> int:
    """The largest power of two from MIN_N up to `max_n` (at least MIN_N) whose product is
    expected to take at most `budget_s`, scaling by n³ from one timed at `probe_n`."""
    n = MIN_N
    while n * 2 <= max_n and probe_s * ((n * 2) / probe_n) ** 3 <= budget_s:
        n *= 2
    return n


def timed(work: Callable[[], None], seconds: float, min_reps: int = MIN_REPS) -> list[float]:
    """One warm-up, then repetitions of `work` (which evaluates) for about `seconds`."""
    work()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - began < seconds:
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return times


def _matrix(shape: tuple[int, int], dtype: mx.Dtype, seed: int) -> mx.array:
    a = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    mx.eval(a)
    return a


def matmul_figure(dtype_name: str, max_n: int, seconds: float) -> dict[str, Any]:
    """GFLOP/s of square products in `dtype_name` on the default device."""
    dtype = getattr(mx, dtype_name)
    probe = min(PROBE_N, max_n)
    a, b = _matrix((probe, probe), dtype, 1), _matrix((probe, probe), dtype, 2)
    probe_s = min(timed(lambda: mx.eval(a @ b), 0.0, min_reps=2))
    n = pick_n(probe_s, probe, max_n, seconds / TARGET_REPS)
    a, b = _matrix((n, n), dtype, 1), _matrix((n, n), dtype, 2)
    times = timed(lambda: mx.eval(a @ b), seconds)
    return {"n": n, "gflops": rate(matmul_flops(n, n, n), times) / 1e9, "reps": len(times)}


def bandwidth_figures(mib: int, seconds: float) -> dict[str, Any]:
    """GB/s copying a large float32 array (x + 1, one read and one write of every byte)
    and reading it (a sum).

    The copy writes into its input's own buffer: the old array is referenced by nothing
    but the new one's graph, so MLX donates its memory to the result. A fresh array each
    time would measure the kernel's page faults instead (~4 GB/s here against ~60 with
    the buffer reused)."""
    count = mib * (1 << 20) // COPY_ELEMENT_BYTES
    nbytes = count * COPY_ELEMENT_BYTES
    held = [mx.random.uniform(shape=(count,), key=mx.random.key(3))]
    mx.eval(held[0])

    def copy() -> None:
        held[0] = held[0] + 1.0
        mx.eval(held[0])

    def read() -> None:
        mx.eval(mx.sum(held[0]))

    copies = timed(copy, seconds / 2)
    reads = timed(read, seconds / 2)
    return {
        "bytes": nbytes,
        "copy_gbs": rate(2 * nbytes, copies) / 1e9,
        "read_gbs": rate(nbytes, reads) / 1e9,
    }


# A decode step's own cost per layer, by kind of layer: mlx-lm's classes at demo size (the
# fixed costs a layer pays whatever its weights: op dispatch, the attention over a short
# cache, a MoE's routing and gathered expert products), through the shard's own CPU
# fusions. The forecast adds the bytes a real layer reads over the measured bandwidth.
# `dense_tp2` is a dense layer cut as one rank of a 2-way tensor group holds it (half the
# heads, KV heads and MLP width; its all-reduces are priced apart): beside `dense` it
# tells how much of a layer's cost shrinks with its share of the weights and how much
# does not (dispatch), which is what a rank of a tensor group of any size pays.
DECODE_KINDS: dict[str, tuple[str, int | None, int]] = {
    "dense": ("llama", None, 1),
    "dense_tp2": ("llama", None, 2),
    "dense_q4": ("llama", 4, 1),
    "moe": ("qwen3_moe", None, 1),
    "moe_q4": ("qwen3_moe", 4, 1),
}
DECODE_LAYERS = (1, 5)  # two depths: the slope is a layer, the rest the step's own cost
DECODE_CONTEXT = 32  # tokens in the cache before the timed steps
DECODE_PAIRS = 12  # least pairs of steps timed per kind


def _decode_model(arch: str, layers: int, bits: int | None, dtype: mx.Dtype, cut: int = 1) -> Any:
    """The demo model of `arch` with `layers` layers; with `cut` > 1, each layer as one
    rank of a `cut`-way tensor group holds it (heads, KV heads and MLP width divided,
    the head width and hidden size kept), without the group's all-reduces."""
    from mlx_lm.utils import quantize_model

    from worker.cpu_fusion import fuse_for_cpu
    from worker.shared.demo_model import DemoSpec, build_model, make_config

    config = make_config(DemoSpec(arch=arch, layers=layers))
    if cut > 1:
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            config[key] //= cut
    model = build_model(config)
    model.set_dtype(dtype)
    if bits is not None:
        # mlx-lm logs the bits per weight on stdout, which is this program's answers.
        with contextlib.redirect_stdout(sys.stderr):
            model, _ = quantize_model(model, config, 64, bits)
    mx.eval(model.parameters())
    fuse_for_cpu([model.model])  # what a shard does on a CPU (a no-op on a GPU)
    return model


def _decoder(model: Any) -> Callable[[], None]:
    """One decode step of `model` (a token in, the argmax out), after a short prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(1, DECODE_CONTEXT + 1)[None], cache=cache))
    token = [mx.array([[5]])]

    def step() -> None:
        logits = model(token[0], cache=cache)
        token[0] = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token[0])

    step()
    return step


def _layer_and_step_s(
    shallow: Callable[[], None], deep: Callable[[], None], seconds: float
) -> tuple[float, float]:
    """(one layer's share of a step, the step's cost outside its layers): the two
    depths are timed in turns, so a load that comes and goes weighs on both alike, and
    the medians of their differences and of the shallow steps are taken."""
    extra = DECODE_LAYERS[1] - DECODE_LAYERS[0]
    diffs: list[float] = []
    lows: list[float] = []
    began = time.perf_counter()
    while len(diffs) < DECODE_PAIRS or time.perf_counter() - began < seconds:
        low = _time_one(shallow)
        diffs.append((_time_one(deep) - low) / extra)
        lows.append(low)
    layer = statistics.median(diffs)
    if layer <= 0:  # noise larger than the layers: the deep model's steps as a whole
        layer = statistics.median(lows) / DECODE_LAYERS[0] / 2
    return layer, max(statistics.median(lows) - layer * DECODE_LAYERS[0], 0.0)


def decode_figures(seconds: float) -> dict[str, float]:
    """µs of one decode step per layer of each kind (`dense`, `dense_tp2`, `dense_q4`,
    `moe`, `moe_q4`), and `step`: a step's cost outside its layers (embedding, head, argmax),
    timed on this device as the forecast prices a stage."""
    # The CPU backend multiplies unquantized experts in float32 only (gather_mm):
    # float32 there; quantized weights keep bfloat16 scales, as mlx-lm's conversions do.
    plain = mx.float32 if mx.default_device().type == mx.DeviceType.cpu else mx.bfloat16
    share = seconds / len(DECODE_KINDS)
    out: dict[str, float] = {}
    fixed = []
    for kind, (arch, bits, cut) in DECODE_KINDS.items():
        dtype = mx.bfloat16 if bits else plain
        shallow, deep = (_decoder(_decode_model(arch, n, bits, dtype, cut)) for n in DECODE_LAYERS)
        layer, step = _layer_and_step_s(shallow, deep, share)
        out[kind] = layer * 1e6
        fixed.append(step)
    out["step"] = statistics.median(fixed) * 1e6
    return out


def check_spec(spec: dict[str, Any]) -> tuple[int, int, float, tuple[str, ...]]:
    """The sizes of a device measurement, refused when out of limits.DEVICE_BENCH_BOUNDS."""
    sizes = {k: v for k, v in spec.items() if k != "dtypes"}
    problem = out_of_bounds(sizes, DEVICE_BENCH_BOUNDS)
    missing = [k for k in DEVICE_BENCH_BOUNDS if k not in spec]
    if problem or missing:
        raise SpecError(problem or f"missing size(s) {', '.join(missing)}")
    dtypes = spec.get("dtypes", DTYPES)
    if not isinstance(dtypes, list | tuple) or not dtypes or set(dtypes) - set(DTYPES):
        raise SpecError(f"dtypes {dtypes!r} are not among {', '.join(DTYPES)}")
    return int(spec["matmul_n"]), int(spec["copy_mib"]), float(spec["seconds"]), tuple(dtypes)


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def device_run(spec: dict[str, Any]) -> dict[str, Any]:
    n, mib, seconds, dtypes = check_spec(spec)
    device = mx.default_device()
    # "gpu" on a Mac (Metal), "cpu" here: which of the node's processors the figures are of.
    figures: dict[str, Any] = {"device": device.type.name, "mlx": version("mlx")}
    matmul: dict[str, Any] = {}
    for name in dtypes:
        _say("step", step=f"matmul {name}")
        matmul[name] = matmul_figure(name, n, seconds)
    figures["matmul"] = matmul
    _say("step", step="memory bandwidth")
    figures["memory"] = bandwidth_figures(mib, seconds)
    _say("step", step="decode step per layer")
    figures["decode"] = decode_figures(seconds)
    return figures


# ---- one rank of the group's distributed product ---------------------------------------


def rank_blocks(n: int, size: int, rank: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Rank `rank`'s share of A (n x n) and B (n x n): A's columns and B's rows of its
    slice of the inner dimension, the same values whichever process makes them."""
    k = n // size
    return _matrix((n, k), dtype, 100 + rank), _matrix((k, n), dtype, 200 + rank)


def group_run(spec: dict[str, Any]) -> dict[str, Any]:
    """C = A @ B with the inner dimension split over the group: each rank multiplies its
    slice and `all_sum` adds the partial products, as a row-parallel layer does. The
    process was started as a job's rank (worker.jobs): its environment names the group."""
    backend = str(spec.get("backend", "ring"))
    if backend not in BACKENDS:
        raise SpecError(f"unknown backend {backend!r}")
    asked = spec.get("reps", TARGET_REPS)
    problem = out_of_bounds({"reps": asked}, GROUP_BENCH_BOUNDS)
    if problem:  # refused before joining: every rank refuses the same
        raise SpecError(problem)
    group = join("jaccl" if backend == "jaccl" else "ring", os.environ)
    size, rank = group.size(), group.rank()
    n = int(spec["n"])
    if n % size or n < size:
        raise SpecError(f"n {n} is not a multiple of the group's {size} ranks")
    dtype = getattr(mx, str(spec.get("dtype", "float32")))
    a, b = rank_blocks(n, size, rank, dtype)

    def step() -> None:
        mx.eval(mx.distributed.all_sum(a @ b, group=group))

    def alone() -> None:
        mx.eval(a @ b)

    # Every rank runs the same number of steps: all_sum waits for all of them.
    reps = max(MIN_REPS, int(asked))
    step()
    together = [_time_one(step) for _ in range(reps)]
    own = [_time_one(alone) for _ in range(reps)]
    out: dict[str, Any] = {
        "rank": rank,
        "size": size,
        "n": n,
        "reps": reps,
        "step_s": statistics.median(together),
        "compute_s": statistics.median(own),
        "gflops": rate(matmul_flops(n, n, n), together) / 1e9,
        "own_gflops": rate(matmul_flops(n, n // size, n), own) / 1e9,
    }
    # One all-reduce of a decode step's activation (a tensor group pays two a layer):
    # latency, not bandwidth, is what it costs.
    small = mx.ones((1, ALLREDUCE_WIDTH), dtype=mx.bfloat16)

    def reduce_small() -> None:
        mx.eval(mx.distributed.all_sum(small, group=group))

    reduce_small()
    reduced = [_time_one(reduce_small) for _ in range(max(reps, ALLREDUCE_REPS))]
    out["allreduce_us"] = statistics.median(reduced) * 1e6
    if spec.get("check", True):
        out["max_error"] = _check(a, b, n, size, rank, dtype, group)
    # No rank may leave while another still has a step in flight over the ring.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return out


def _time_one(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _check(
    a: mx.array, b: mx.array, n: int, size: int, rank: int, dtype: mx.Dtype, group: Any
) -> float:
    """The largest difference, relative to the largest value, between the group's
    product and the same product made whole on this rank from every rank's blocks."""
    got = mx.distributed.all_sum(a @ b, group=group).astype(mx.float32)
    want = sum(
        (x @ y for x, y in (rank_blocks(n, size, r, dtype) for r in range(size))),
        start=mx.zeros((n, n), dtype=dtype),
    ).astype(mx.float32)
    ratio: Any = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-12)).item()
    return float(ratio)


def job_main(spec_path: str) -> int:
    """One rank of a `benchmark` job (worker.jobs runs `python -m worker.device_bench
    SPEC.json`): beats while it works, then its figures as the `result` event."""
    jobs.own_stdout()
    jobs.start_beating()
    try:
        figures = group_run(jobs.read_spec(spec_path))
    except (SpecError, GroupError, jobs.JobError, ValueError, KeyError, RuntimeError) as exc:
        jobs.emit("fatal", message=f"{type(exc).__name__}: {exc}")
        return 1
    jobs.emit("result", figures=figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and args[0].endswith(".json") and Path(args[0]).is_file():
        return job_main(args[0])
    try:
        figures = device_run(json.loads(args[-1]) if args else {})
    except (SpecError, ValueError, KeyError, RuntimeError, MemoryError) as exc:
        _say("fatal", message=f"{type(exc).__name__}: {exc}")
        return 1
    _say("figures", figures=figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
