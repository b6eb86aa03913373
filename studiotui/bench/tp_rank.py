"""mlx-lm's own tensor parallel, for `studiotui bench` to compare with.

Run by `mlx.launch --backend ring -n 2`: every rank loads the model lazily, keeps its
slice of every layer (`model.shard(group)`, as mlx-lm's sharded generate does) and
runs mlx-lm's generate loop; rank 0 prints the decode tokens/s and tokens as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def main() -> None:
    path, n_prompt, n_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    group = mx.distributed.init(strict=True)
    model, _ = load_model(Path(path), lazy=True)
    model.shard(group)
    mx.eval(model.parameters())
    prompt = mx.array([(7 * i) % 200 + 32 for i in range(n_prompt)])
    rounds = []
    for _ in range(2):  # the first run warms up; the second is the figure
        tokens: list[int] = []
        first = 0.0
        for tok, _ in generate_step(prompt, model, max_tokens=n_tokens):
            tokens.append(int(tok))
            if len(tokens) == 1:
                first = time.perf_counter()
        rounds.append(((len(tokens) - 1) / (time.perf_counter() - first), tokens))
    # No rank may leave while another still has a step in flight over the ring.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    if group.rank() == 0:
        tps, tokens = rounds[-1]
        print(json.dumps({"tps": tps, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
