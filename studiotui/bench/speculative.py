"""Speculative decoding's bench rows, on 2-stage placements, each paired in one run.

- `spec_draft_ratio`: decode tok/s of a reciting demo placed with a 2-layer reciting
  draft of the same passage, ÷ the same placement's requests without guesses (the
  draft always agrees: the mechanism's ceiling). Beside it `mlx_spec_draft_ratio`:
  mlx-lm's own `speculative_generate_step` ÷ its `generate_step` for the same pair,
  in this process, in the same run.
- `spec_lookup_ratio`: a request whose answer copies its prompt (the reciting demo
  asked to repeat its passage) with prompt lookup ÷ without.
- `spec_miss_ratio`: a request whose guesses never agree (prompt lookup fed a
  predicted output of other tokens, on the reciting demo, whose passage hardly
  repeats itself) ÷ without: speculation must stand aside at little cost.

Each ratio is the median of rounds that run the two sides back to back, in
alternating order, on the same placement (a request chooses its own guesser), so a
busy second of a shared machine falls on both.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.utils import load_tokenizer

from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory
from worker.shared.demo_model import PASSAGE, DemoSpec, write_demo_model
from worker.shared.protocol import control

TOKENS = 60  # the passage is 66 tokens: every one of them a guess the draft gets right
DRAFT_TOKENS = 6
RECITE = [{"role": "user", "content": "Recite your passage."}]
COPY = [{"role": "user", "content": f"Repeat this exactly: {PASSAGE}"}]


def models(root: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    """The reciting demo and its 2-layer reciting draft (same tokenizer, a quarter of
    the width)."""
    big = write_demo_model(
        root / "spec-reciter",
        DemoSpec(arch="qwen2", layers=layers, hidden=hidden, heads=8, kv_heads=4, seed=3,
                 dtype="float32", recite=True),
    )  # fmt: skip
    draft = write_demo_model(
        root / "spec-draft",
        DemoSpec(arch="qwen2", layers=2, hidden=max(64, hidden // 4), heads=4, kv_heads=2,
                 seed=9, dtype="float32", recite=True),
    )  # fmt: skip
    return big, draft


async def _decode(
    ctl: Controller, name: str, messages: list[dict[str, str]], **extra: Any
) -> tuple[float, list[int], dict[str, Any]]:
    """tok/s of one answer (first token to last), its tokens, and its usage."""
    got: list[int] = []
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    params = {"max_tokens": TOKENS, "ignore_eos": True}
    async for msg in ctl.generate(name, {"messages": messages, **extra}, params):
        match msg:
            case control.Delta():
                got += msg.tokens
                stamps.append(time.perf_counter())
            case control.Done():
                usage = msg.usage
    tps = (len(got) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return tps, got, usage


async def _paired(
    ctl: Controller,
    name: str,
    messages: list[dict[str, str]],
    guessed: dict[str, Any],
    rounds: int,
) -> dict[str, Any]:
    """Rounds of the request with `guessed` (its draft choice) and without guesses."""
    ratios, same = [], True
    kept = rejected = 0
    await _decode(ctl, name, messages, draft="")  # warm up
    for r in range(rounds):
        sides: dict[str, tuple[float, list[int], dict[str, Any]]] = {}
        for side in ("with", "without") if r % 2 else ("without", "with"):
            extra = guessed if side == "with" else {"draft": ""}
            sides[side] = await _decode(ctl, name, messages, **extra)
        ratios.append(sides["with"][0] / sides["without"][0])
        same = same and sides["with"][1] == sides["without"][1]
        details = sides["with"][2].get("completion_tokens_details") or {}
        kept += details.get("accepted_prediction_tokens", 0)
        rejected += details.get("rejected_prediction_tokens", 0)
    return {
        "ratio": round(statistics.median(ratios), 3),
        "same": same,
        "acceptance": round(kept / (kept + rejected), 3) if kept + rejected else None,
    }


def mlx_draft_ratio(big: Path, draft: Path, rounds: int) -> float:
    """mlx-lm's `speculative_generate_step` ÷ `generate_step` tok/s for the same pair and
    prompt, greedy, in this process, rounds alternating."""
    model = mlx_lm.load(str(big))[0]
    guesser = mlx_lm.load(str(draft))[0]
    prompt = mx.array(load_tokenizer(big).apply_chat_template(RECITE, add_generation_prompt=True))

    def tps(steps: Any) -> float:
        stamps = []
        for _ in steps:
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def plain() -> float:
        return tps(generate_step(prompt, model, max_tokens=TOKENS))

    def speculative() -> float:
        return tps(
            speculative_generate_step(
                prompt, model, guesser, num_draft_tokens=DRAFT_TOKENS, max_tokens=TOKENS
            )
        )

    plain(), speculative()  # warm up
    ratios = []
    for r in range(rounds):
        if r % 2:
            s, p = speculative(), plain()
        else:
            p, s = plain(), speculative()
        ratios.append(s / p)
    return round(statistics.median(ratios), 3)


async def spec_figures(
    home: Path, inv: Inventory, layers: int, hidden: int, rounds: int, prefill_chunk: int = 128
) -> dict[str, Any]:
    """The three rows (and mlx-lm's), on one placement over two of `inv`'s nodes."""
    big, draft = models(home / "models", layers, hidden)
    ctl = Controller(home, inv)
    out: dict[str, Any] = {}
    try:
        await ctl.refresh()
        nodes = list(inv.names)[:2]
        await ctl.place(
            big,
            nodes,
            "spec-draft",
            prefill_chunk=prefill_chunk,
            draft_dir=str(draft),
            draft_tokens=DRAFT_TOKENS,
        )
        drafted = await _paired(ctl, "spec-draft", RECITE, {}, rounds)
        lookup = await _paired(ctl, "spec-draft", COPY, {"draft": "lookup"}, rounds)
        _, answer, _ = await _decode(ctl, "spec-draft", RECITE, draft="")
        never = [(t + 1) % 256 for t in answer]
        wrong = {"draft": "lookup", "prediction": never}
        miss = await _paired(ctl, "spec-draft", RECITE, wrong, rounds)
        await ctl.unload("spec-draft")
    finally:
        await ctl.close()
    out["mlx_spec_draft_ratio"] = await asyncio.to_thread(mlx_draft_ratio, big, draft, rounds)
    out.update(
        spec_draft_ratio=drafted["ratio"],
        spec_draft_acceptance=drafted["acceptance"],
        spec_lookup_ratio=lookup["ratio"],
        spec_lookup_acceptance=lookup["acceptance"],
        spec_miss_ratio=miss["ratio"],
        spec_miss_acceptance=miss["acceptance"],
        # Guesses change how many trips a token takes, never which token it is.
        spec_tokens_match=drafted["same"] and lookup["same"] and miss["same"],
    )
    return out
