"""Speculative decoding's choice at placing: a guesser the head runs (`--draft`).

Checked before anything moves: a draft model must share the model's tokenizer (its
guesses are token ids the model's verify frame reads as its own), a family whose caches
cannot be cut back after a rejected guess is refused, and the draft's weights are
counted in the head node's memory (it is loaded whole there, beside the first stage).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from studiotui.core.placement import Plan, Refusal, format_bytes

MODES = ("lookup", "model")
# Families whose caches hold linear attention's running state (mlx-lm's ArraysCache):
# it cannot be cut back to before a rejected guess.
UNTRIMMABLE = {
    "qwen3_next": "Qwen3-Next's linear attention (ArraysCache)",
    "qwen3_5": "Qwen3.5's linear attention (ArraysCache)",
    "qwen3_5_moe": "Qwen3.5 MoE's linear attention (ArraysCache)",
}
MAX_DRAFT_TOKENS = 16  # worker/speculation.py MAX_DRAFT_TOKENS


class DraftRefused(ValueError):
    pass


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DraftRefused(f"{model_dir} has no readable config.json: {exc}") from None
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else dict(raw)


def _vocabulary(model_dir: Path) -> str:
    """A digest of the tokenizer's vocabulary and added tokens ("" without tokenizer.json)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return ""
    try:
        tok = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DraftRefused(f"{path} is not readable JSON: {exc}") from None
    model = tok.get("model") or {}
    added = sorted((t.get("id"), t.get("content")) for t in tok.get("added_tokens") or [])
    blob = json.dumps([model.get("vocab"), added], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_draft(model_dir: Path, draft: str, draft_dir: Path | None, draft_tokens: int) -> str:
    """Why this draft cannot serve this model, in words ("" if it can)."""
    if draft not in MODES:
        return f"--draft {draft!r}: give 'lookup' (prompt lookup) or a draft model's directory"
    if not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        return f"--draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, got {draft_tokens}"
    model = _config(model_dir)
    family = str(model.get("model_type", ""))
    if family in UNTRIMMABLE:
        return (
            f"{model_dir.name} cannot speculate: {UNTRIMMABLE[family]} cannot be cut back "
            "after a rejected guess; place it without --draft"
        )
    if draft == "lookup":
        return ""
    assert draft_dir is not None
    if not (draft_dir / "config.json").is_file():
        return f"--draft {draft_dir}: no config.json there (a draft is an mlx-lm model directory)"
    other = _config(draft_dir)
    if other.get("vocab_size") != model.get("vocab_size"):
        return (
            f"the draft {draft_dir.name} has a vocabulary of {other.get('vocab_size')} tokens, "
            f"{model_dir.name} {model.get('vocab_size')}: a draft must use the model's own "
            "tokenizer (a smaller model of the same family, e.g. Qwen3-0.6B for Qwen3-235B)"
        )
    mine, theirs = _vocabulary(model_dir), _vocabulary(draft_dir)
    if mine and theirs and mine != theirs:
        return (
            f"the draft {draft_dir.name}'s tokenizer differs from {model_dir.name}'s (same size, "
            "other tokens): its guesses would be other words; pick a draft of the same family"
        )
    return ""


def draft_bytes(draft_dir: Path) -> int:
    """The draft model's weights, as loaded whole (its safetensors files)."""
    return sum(p.stat().st_size for p in draft_dir.glob("*.safetensors"))


def with_draft(plan: Plan | Refusal, weights: int) -> Plan | Refusal:
    """The plan with the draft's weights on the head node (its first stage's first node),
    or the refusal saying they do not fit there."""
    if isinstance(plan, Refusal) or weights <= 0:
        return plan
    head = plan.shards[0]
    if head.free_after < weights:
        return Refusal(
            f"the draft model ({format_bytes(weights)}) does not fit on {head.node} beside the "
            f"first stage ({format_bytes(max(0, head.free_after))} free after it): pick a "
            "smaller draft, or use --draft lookup"
        )
    first = replace(head, free_after=head.free_after - weights, draft_bytes=weights)
    return replace(plan, shards=(first, *plan.shards[1:]))
