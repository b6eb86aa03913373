"""A real LoRA adapter for a demo model, made with mlx-lm's own pieces.

`linear_to_lora_layers` converts the model's projections into mlx-lm's LoRA
layers, as its trainer does; mlx-lm starts lora_b at zero (an adapter that
changes nothing), so lora_b gets deterministic nonzero values instead of
training. Saved as mlx-lm's trainer saves: the trainable parameters in
adapters.safetensors and the LoRA settings in adapter_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model

from worker.shared.adapters import stamp_identity


def write_adapter(
    model_dir: Path,
    out: Path,
    *,
    num_layers: int = 2,
    rank: int = 4,
    scale: float = 4.0,
    keys: list[str] | None = None,
    seed: int = 3,
    stamp: bool = True,
    dora: bool = False,
) -> Path:
    model, _ = load_model(model_dir)
    model.freeze()
    params: dict[str, object] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        # lora_a too: a fixed seed makes the adapter the same bytes on every run.
        if name.endswith(("lora_a", "lora_b")):
            value = mx.array(rng.normal(0.0, 0.3, value.shape).astype(np.float32))
        weights[name] = value
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {
        "model": str(model_dir),
        "fine_tune_type": "dora" if dora else "lora",
        "num_layers": num_layers,
        "lora_parameters": params,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=4))
    if stamp:
        stamp_identity(out, model_dir)
    return out


WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "cats",
    "sleep",
]


def write_training_text(path: Path, n: int = 48) -> Path:
    """Text examples of 8 words, rotations of one sentence: a pattern to learn."""
    rows = [{"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8))} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
