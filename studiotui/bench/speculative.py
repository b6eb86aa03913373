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
import os
import statistics
import time
from dataclasses import dataclass
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
# Pairs a row's median is taken over (each side twice the answers of a pair at most).
ROUNDS = 7
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


@dataclass
class Answer:
    """One answer as the client saw it: each delta's tokens and when it came."""

    deltas: list[list[int]]
    stamps: list[float]
    usage: dict[str, Any]

    @property
    def tokens(self) -> list[int]:
        return [t for delta in self.deltas for t in delta]

    @property
    def tps(self) -> float:
        """Decode tok/s: the tokens after the first delta (the prefill's) over the time
        from it to the last delta."""
        if len(self.stamps) < 2:
            return 0.0
        after = sum(len(d) for d in self.deltas[1:])
        return after / (self.stamps[-1] - self.stamps[0])

    def steps(self, size: int) -> list[float]:
        """The seconds of each step that brought a delta of `size` tokens (from the
        delta before it to it: one trip of the ring, the next step already launched)."""
        return [
            self.stamps[i] - self.stamps[i - 1]
            for i in range(1, len(self.deltas))
            if len(self.deltas[i]) == size
        ]


async def _answer(
    ctl: Controller, name: str, messages: list[dict[str, str]], **extra: Any
) -> Answer:
    deltas: list[list[int]] = []
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    params = {"max_tokens": TOKENS, "ignore_eos": True}
    async for msg in ctl.generate(name, {"messages": messages, **extra}, params):
        match msg:
            case control.Delta() if msg.tokens:
                deltas.append(list(msg.tokens))
                stamps.append(time.perf_counter())
            case control.Done():
                usage = msg.usage or {}
    return Answer(deltas, stamps, usage)


async def _decode(
    ctl: Controller, name: str, messages: list[dict[str, str]], **extra: Any
) -> tuple[float, list[int], dict[str, Any]]:
    """tok/s of one answer (first token to last), its tokens, and its usage."""
    got = await _answer(ctl, name, messages, **extra)
    return got.tps, got.tokens, got.usage


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


async def _ceiling(
    ctl: Controller, name: str, messages: list[dict[str, str]], answer: list[int], rounds: int
) -> tuple[float | None, int]:
    """`spec_verify_ceiling`: (K + 1) one-token decode steps ÷ one step verifying K
    guesses, on this placement, at the widest K a request's guesses reach (returned
    too). The verify steps are those of a request whose prediction is its own answer
    (every guess kept, so K grows as far as it goes); each round pairs it with the
    request without guesses, back to back, in alternating order."""
    perfect = {"draft": "lookup", "prediction": answer}
    paired: list[tuple[Answer, Answer]] = []
    for r in range(rounds):
        sides: dict[str, Answer] = {}
        for side in ("with", "without") if r % 2 else ("without", "with"):
            sides[side] = await _answer(
                ctl, name, messages, **(perfect if side == "with" else {"draft": ""})
            )
        paired.append((sides["with"], sides["without"]))
    widest = max((len(d) for w, _ in paired for d in w.deltas[1:]), default=1)
    ceilings = []
    for wide, plain in paired:
        one, verify = plain.steps(1), wide.steps(widest)
        if one and verify and widest > 1:
            ceilings.append(widest * statistics.median(one) / statistics.median(verify))
    return (round(statistics.median(ceilings), 3) if ceilings else None), widest - 1


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
        ceiling, widest = await _ceiling(ctl, "spec-draft", COPY, answer, rounds)
        await ctl.unload("spec-draft")
    finally:
        await ctl.close()
    out["mlx_spec_draft_ratio"] = await asyncio.to_thread(mlx_draft_ratio, big, draft, rounds)
    out.update(
        {
            "spec_draft_ratio": drafted["ratio"],
            "spec_draft_acceptance": drafted["acceptance"],
            "spec_lookup_ratio": lookup["ratio"],
            "spec_lookup_acceptance": lookup["acceptance"],
            "spec_miss_ratio": miss["ratio"],
            "spec_miss_acceptance": miss["acceptance"],
            "spec_verify_ceiling": ceiling,
            "spec_verify_ceiling_guesses": widest,
            "spec_lookup_of_ceiling": (round(lookup["ratio"] / ceiling, 3) if ceiling else None),
            "spec_load_avg": round(os.getloadavg()[0], 2),
            # Guesses change how many trips a token takes, never which token it is.
            "spec_tokens_match": drafted["same"] and lookup["same"] and miss["same"],
        }
    )
    return out
