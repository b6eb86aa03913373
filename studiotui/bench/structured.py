"""`structured_tok_ratio`: what a JSON schema costs a decode. The same prompt on the same
two-stage placement, decoded with a `json_schema` response format (the tail masks each
step's logits with llguidance's grammar, `worker.shared.structured`) and without, the
sides alternating run by run; the ratio is the median of the pairs' tokens/s, schema
over free. The schema holds the answer inside one long string (`minLength`), so every
run decodes its full length under the grammar rather than closing the object early.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from studiotui.cluster.controller import Controller
from studiotui.cluster.streams import prompt_tokens, stream
from worker.shared.structured import response_format_grammar

NAME = "bench-structured"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 4000}},
    "required": ["answer"],
    "additionalProperties": False,
}


def schema_grammar() -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return response_format_grammar(fmt)


async def structured_figures(
    ctl: Controller,
    model_dir: Path,
    nodes: list[str],
    prefill_chunk: int,
    tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """Paired decode runs with and without the schema on a placement of its own."""
    grammar = {"grammar": schema_grammar()}
    prompt = prompt_tokens(16)
    await ctl.place(model_dir, nodes, NAME, prefill_chunk=prefill_chunk)
    try:
        await stream(ctl, NAME, prompt, 8)  # warm up both paths
        await stream(ctl, NAME, prompt, 8, grammar)
        free: list[dict[str, Any]] = []
        held: list[dict[str, Any]] = []
        for r in range(rounds):
            for side in ("free", "schema") if r % 2 == 0 else ("schema", "free"):
                if side == "free":
                    free.append(await stream(ctl, NAME, prompt, tokens))
                else:
                    held.append(await stream(ctl, NAME, prompt, tokens, grammar))
    finally:
        await ctl.unload(NAME)
    ratios = [s["tps"] / f["tps"] for s, f in zip(held, free, strict=True) if f["tps"]]
    return {
        "structured_tok_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "structured_pairs": [round(r, 3) for r in ratios],
        "structured_tps": round(statistics.median(s["tps"] for s in held), 2),
        "structured_free_tps": round(statistics.median(f["tps"] for f in free), 2),
        # Every constrained run decoded its full length (the grammar never ended it).
        "structured_full_runs": all(len(s["tokens"]) == tokens for s in held),
    }
