"""One rank of a LoRA / QLoRA fine-tuning job: `python -m worker.finetune SPEC.json`.

Started by the agent (worker/jobs.py) with the group's environment (worker/group.py).
Everything that trains is mlx-lm's own: `load`, `linear_to_lora_layers` (LoRA on
`Linear`, QLoRA on `QuantizedLinear`), its datasets (`create_dataset`: chat,
completions, text) and its trainer (`mlx_lm.tuner.trainer.train`), which averages the
gradients over `mx.distributed.init()` — the group this process was launched into.

Data parallel, each rank reading only its own files: the operator dealt every global
batch of `batch_size` examples over the ranks (studiotui/tune/data.py), so this
rank's file holds its `batch_size / size` examples of each batch in batch order.
`iterate_batches` is mlx-lm's own, asked for the local batch size with no group:
the same seed on every rank permutes the batches alike, so the ranks' step t is the
one global batch of step t of a one-node run.

Every rank saves the adapter (identical on all of them after each step) every
`save_every` iterations as `NNNNNNN_adapters.safetensors` and `adapters.safetensors`,
next to `adapter_config.json` (mlx-lm's format, plus `studiotui_base`: the base
model's name and content digest), and beside it the optimizer's state as
`NNNNNNN_optimizer.safetensors` (MLX's own `tree_flatten` of `optimizer.state`:
Adam's moments, the step count). The ranks apply the same all-reduced gradients, so
that state is identical on every rank too; each rank keeps its own copy because a
rank resumes from its own node's disk. A resumed job starts from the last iteration
every rank has saved (agreed with `all_min`), with that iteration's adapter and
optimizer state, and the batches go on where they stopped (mlx-lm's permutations
replayed from the job's seed, on a numpy generator validation does not draw from):
it is the run that would have happened unstopped.
mlx-lm's own `--resume-adapter-file` restores the adapter only.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm import load
from mlx_lm.tuner import trainer
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.datasets import CacheDataset, create_dataset
from mlx_lm.tuner.utils import linear_to_lora_layers

from worker import group, jobs
from worker.shared.tensors import named_arrays

KEEP_CHECKPOINTS = 3
OPTIMIZERS = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD}


def checkpoint_name(iteration: int) -> str:
    return f"{iteration:07d}_adapters.safetensors"


def optimizer_name(iteration: int) -> str:
    """The optimizer's state saved with the adapter of that iteration."""
    return f"{iteration:07d}_optimizer.safetensors"


def saved_iterations(adapter_dir: Path) -> list[int]:
    found = []
    for path in adapter_dir.glob("*_adapters.safetensors"):
        head = path.name.split("_", 1)[0]
        if head.isdigit():
            found.append(int(head))
    return sorted(found)


def adapter_config(spec: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """mlx-lm's adapter_config.json (what `load_adapters` reads), with the base's identity."""
    return {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {
            "rank": int(spec["lora_rank"]),
            "scale": float(spec.get("lora_scale", 20.0)),
            "dropout": 0.0,
        },
        "model": spec["model_dir"],
        "batch_size": int(spec["batch_size"]),
        "iters": int(spec["iters"]),
        "learning_rate": float(spec["learning_rate"]),
        "optimizer": spec.get("optimizer", "adam"),
        "seed": int(spec.get("seed", 0)),
        "max_seq_length": int(spec.get("max_seq_length", 2048)),
        "studiotui_base": spec["base"],
    }


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    os.replace(tmp, path)


def save_adapter(model: Any, adapter_dir: Path, iteration: int) -> Path:
    weights = dict(named_arrays(model.trainable_parameters()))
    target = adapter_dir / checkpoint_name(iteration)
    _write_atomic(target, lambda p: mx.save_safetensors(str(p), weights))
    _write_atomic(
        adapter_dir / "adapters.safetensors", lambda p: mx.save_safetensors(str(p), weights)
    )
    for old in saved_iterations(adapter_dir)[:-KEEP_CHECKPOINTS]:
        (adapter_dir / checkpoint_name(old)).unlink(missing_ok=True)
        (adapter_dir / optimizer_name(old)).unlink(missing_ok=True)
    return target


def save_optimizer(optimizer: optim.Optimizer, adapter_dir: Path, iteration: int) -> Path:
    """The optimizer's whole state (MLX's documented way: its flattened tree as
    safetensors), written before the adapter of the same iteration so a saved adapter
    always has its state beside it."""
    state = dict(named_arrays(optimizer.state))
    target = adapter_dir / optimizer_name(iteration)
    _write_atomic(target, lambda p: mx.save_safetensors(str(p), state))
    return target


def restore_optimizer(optimizer: optim.Optimizer, model: Any, path: Path) -> None:
    """Put a saved state back, after checking it is of this model's trainable tree (the
    same LoRA layers and optimizer) so it cannot half-apply."""
    saved = cast(dict[str, mx.array], mx.load(str(path)))
    optimizer.init(model.trainable_parameters())
    expected = {name for name, _ in named_arrays(optimizer.state)}
    if set(saved) != expected:
        odd = sorted(set(saved) ^ expected)
        raise RuntimeError(
            f"{path} is not this job's optimizer state ({len(odd)} names differ, e.g. "
            f"{odd[0]}): resume with the settings the job was started with"
        )
    optimizer.state = tree_unflatten(list(saved.items()))


class Reporter(TrainingCallback):
    """mlx-lm's reports as job events (iterations counted from the job's start), and
    the adapter and the optimizer's state saved every `save_every` iterations on every
    rank. mlx-lm calls the report after the step's update is evaluated, so both are
    the state after iteration `it`."""

    def __init__(
        self,
        model: Any,
        optimizer: optim.Optimizer,
        adapter_dir: Path,
        offset: int,
        total: int,
        every: int,
    ):
        self.model, self.optimizer, self.adapter_dir = model, optimizer, adapter_dir
        self.offset, self.total, self.every = offset, total, every
        self.last_saved = offset

    def on_train_loss_report(self, train_info: dict[str, Any]) -> None:
        it = int(train_info["iteration"]) + self.offset
        jobs.emit(
            "metrics",
            iteration=it,
            total=self.total,
            train_loss=float(train_info["train_loss"]),
            learning_rate=float(train_info["learning_rate"]),
            iterations_per_second=float(train_info["iterations_per_second"]),
            tokens_per_second=float(train_info["tokens_per_second"]),
            trained_tokens=int(train_info["trained_tokens"]),
            peak_memory=float(train_info["peak_memory"]),
            memory=mx.get_active_memory(),
            time=time.time(),
        )
        if it - self.last_saved >= self.every or it == self.total:
            save_optimizer(self.optimizer, self.adapter_dir, it)
            path = save_adapter(self.model, self.adapter_dir, it)
            self.last_saved = it
            jobs.emit("saved", iteration=it, path=str(path))

    def on_val_loss_report(self, val_info: dict[str, Any]) -> None:
        jobs.emit(
            "val",
            iteration=int(val_info["iteration"]) + self.offset,
            val_loss=float(val_info["val_loss"]),
            val_time=float(val_info["val_time"]),
        )


def own_generator(batches: Iterator[Any]) -> Iterator[Any]:
    """`batches` drawing on numpy's global generator as if no one else did. mlx-lm's
    `iterate_batches` seeds it once and draws each pass's permutation from it, and so
    does every validation pass (unseeded) in between: the training order would depend
    on when validation ran, which differs between a run and the same run resumed."""
    mine: Any = None
    while True:
        outer = np.random.get_state()
        if mine is not None:
            np.random.set_state(mine)
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            mine = np.random.get_state()
            np.random.set_state(outer)
        yield batch


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def agreed_start(adapter_dir: Path, world: mx.distributed.Group) -> int:
    """The last iteration every rank has saved (0: none)."""
    mine = saved_iterations(adapter_dir)
    latest = mine[-1] if mine else 0
    if world.size() > 1:
        least = mx.distributed.all_min(mx.array(latest), group=world, stream=mx.cpu)
        latest = cast(int, least.item())
    if latest and latest not in mine:
        raise RuntimeError(f"this rank has no adapter saved at iteration {latest} to resume from")
    return latest


def run(spec: dict[str, Any]) -> None:
    size = int(spec["size"])
    world = group.join(spec["backend"], os.environ) if size > 1 else mx.distributed.init()
    adapter_dir = Path(spec["directory"]).parent / "adapters"
    adapter_dir.mkdir(parents=True, exist_ok=True)
    jobs.emit("loading", model=spec["model_dir"])
    loaded = load(spec["model_dir"])
    model, tokenizer = loaded[0], cast(Any, loaded[1])
    data_dir = Path(spec["data_dir"])
    config = types.SimpleNamespace(mask_prompt=False)
    train_set = create_dataset(read_jsonl(data_dir / spec["train_file"]), tokenizer, config)
    valid_rows = read_jsonl(data_dir / spec["valid_file"]) if spec.get("valid_file") else []
    valid_set = create_dataset(valid_rows, tokenizer, config) if valid_rows else None

    seed = int(spec.get("seed", 0))
    mx.random.seed(seed)  # the LoRA matrices start alike on every rank and every run
    model.freeze()
    num_layers = min(int(spec.get("num_layers", 16)), len(model.layers))
    if num_layers <= 0:
        num_layers = len(model.layers)
    lora = {"rank": int(spec["lora_rank"]), "scale": float(spec.get("lora_scale", 20.0))}
    linear_to_lora_layers(model, num_layers, {**lora, "dropout": 0.0})
    config_text = json.dumps(adapter_config(spec, num_layers), indent=2)
    _write_atomic(adapter_dir / "adapter_config.json", lambda p: p.write_text(config_text))

    total = int(spec["iters"])
    name = str(spec.get("optimizer", "adam"))
    optimizer = OPTIMIZERS[name](learning_rate=float(spec["learning_rate"]))
    start = agreed_start(adapter_dir, world) if spec.get("resume") else 0
    restored = False
    if start:
        model.load_weights(str(adapter_dir / checkpoint_name(start)), strict=False)
        state = adapter_dir / optimizer_name(start)
        # A job saved before optimizer states were kept resumes with a fresh one (said
        # in the ready event): still trainable, not the unstopped run.
        if state.is_file():
            restore_optimizer(optimizer, model, state)
            restored = True
    trainable = sum(v.size for _, v in named_arrays(model.trainable_parameters()))
    jobs.emit(
        "ready",
        start_iteration=start,
        total=total,
        trainable_parameters=int(trainable),
        train_examples=len(train_set),
        valid_examples=len(valid_rows),
        optimizer_restored=restored,
    )
    if start >= total:
        jobs.emit("finished", iteration=start, adapter_dir=str(adapter_dir))
        return
    left = total - start
    local = int(spec["batch_size"]) // size

    def batches(
        dataset: Any,
        batch_size: int,
        max_seq_length: int,
        loop: bool = False,
        seed: int | None = None,
        comm_group: Any = None,
    ) -> Any:
        # mlx-lm's own batching of this rank's share: `batch_size` is the global batch.
        found = trainer.iterate_batches(
            dataset,
            batch_size // size,
            max_seq_length,
            loop=loop,
            seed=int(spec.get("seed", 0)) if loop else None,
            comm_group=None,
        )
        if not loop:
            return found
        # Resumed: the same seeded permutations, past the `start` batches already
        # trained on, so step t gets the batch the unstopped run's step t got.
        return itertools.islice(own_generator(found), start, None)

    args = trainer.TrainingArgs(
        batch_size=local * size,
        iters=left,
        val_batches=int(spec.get("val_batches", 25)),
        steps_per_report=int(spec.get("steps_per_report", 1)),
        steps_per_eval=int(spec.get("steps_per_eval", max(left, 1))),
        # mlx-lm saves on rank 0 only; every rank saves here (Reporter) instead.
        steps_per_save=left + 1,
        adapter_file=str(adapter_dir / f".final-rank{world.rank()}.safetensors"),
        max_seq_length=int(spec.get("max_seq_length", 2048)),
    )
    every = int(spec.get("save_every", 100))
    reporter = Reporter(model, optimizer, adapter_dir, start, total, every)
    trainer.train(
        model=model,
        optimizer=optimizer,
        train_dataset=CacheDataset(train_set),
        val_dataset=CacheDataset(valid_set) if valid_set is not None else None,
        args=args,
        iterate_batches=batches,
        training_callback=reporter,
    )
    Path(args.adapter_file).unlink(missing_ok=True)
    jobs.emit("finished", iteration=total, adapter_dir=str(adapter_dir))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    jobs.own_stdout()  # mlx-lm's console output goes to stderr; stdout carries events
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    jobs.start_beating()
    try:
        spec = jobs.read_spec(argv[0])
        run(spec)
    except Exception as exc:  # the job's end, said in words for the operator
        jobs.emit("fatal", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
