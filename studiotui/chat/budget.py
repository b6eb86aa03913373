"""How much of a conversation goes into one prompt: pure arithmetic on characters.

A placement's tokenizer is not on the operator's side in general, so the chat
budgets in characters, with a characters-per-token ratio that is learned from each
answer's prompt token count, measured with the model's own tokenizer when its files
are on this machine, or guessed. The head shard counts the real tokens and refuses
what does not fit, so a wrong ratio costs an answer cut short, never a wrong one.
"""

from __future__ import annotations

from studiotui.chat.history import Message

# `studiotui place` reserves KV memory for this many tokens by default, and the chat
# budgets its prompts for it.
CONTEXT_TOKENS = 4096
TEMPLATE_TOKENS = 64  # what a chat template adds around the messages, roughly
# Until a placement's first answer tells how many tokens a prompt really made,
# assume 3 characters a token (English with a BPE vocabulary makes about 4).
GUESS_CHARS_PER_TOKEN = 3.0
# A short prompt is mostly chat template: it would teach a wrong ratio.
CALIBRATE_CHARS = 2000
MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN = 0.5, 8.0
PASSAGE_SHARE = 0.75  # of the prompt budget, for passages; the rest for earlier turns
MESSAGE_OVERHEAD_CHARS = 16  # a message's role and separators, in characters


def prompt_budget_chars(
    max_tokens: int, chars_per_token: float, context_tokens: int | None = None
) -> int:
    """Characters of prompt that leave room for the answer in the placement's context
    (`context_tokens`, what its shards reserved KV memory for; the default when the
    placement does not say)."""
    context = context_tokens or CONTEXT_TOKENS
    tokens = max(context - max_tokens - TEMPLATE_TOKENS, context // 8)
    return int(tokens * chars_per_token)


def passage_room(budget_chars: int, system: str, question: str) -> int:
    """Characters the passages of attached documents may take: a share of what the
    system prompt and the question leave, the rest kept for earlier turns."""
    return int(max(budget_chars - len(system) - len(question), 0) * PASSAGE_SHARE)


def learned_ratio(chars_sent: int, prompt_tokens: int | None) -> float | None:
    """Characters per token taught by a prompt of `chars_sent` characters that made
    `prompt_tokens` tokens, or None when the prompt was too short to teach anything."""
    content_tokens = (prompt_tokens or 0) - TEMPLATE_TOKENS
    if chars_sent < CALIBRATE_CHARS or content_tokens <= 0:
        return None
    return min(max(chars_sent / content_tokens, MIN_CHARS_PER_TOKEN), MAX_CHARS_PER_TOKEN)


def request_messages(
    system: str, messages: list[Message], budget_chars: int
) -> tuple[list[dict[str, str]], int]:
    """The messages to send for the last (user) message, and how many earlier ones
    were left out to fit the budget. Earlier questions go as typed: only the
    question being answered carries its document passages."""
    *earlier, last = messages
    final = {"role": "user", "content": last.sent or last.content}
    used = len(system) + len(final["content"])
    wanted = [m for m in earlier if m.content.strip()]
    kept: list[dict[str, str]] = []
    for m in reversed(wanted):
        size = len(m.content) + MESSAGE_OVERHEAD_CHARS
        if used + size > budget_chars:
            break
        kept.append({"role": m.role, "content": m.content})
        used += size
    kept.reverse()
    # Chat templates expect a user turn first.
    while kept and kept[0]["role"] == "assistant":
        kept.pop(0)
    head = [{"role": "system", "content": system}] if system else []
    return [*head, *kept, final], len(wanted) - len(kept)
