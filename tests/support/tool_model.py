"""A demo model that answers every chat with one tool call, for end-to-end tool tests.

It is the reciting demo (worker/demo_model.py, docs/notes/families.md "The first-run
demo recites") with another passage: a written demo model, whose tokenizer then
gains Qwen's `<tool_call>` / `</tool_call>` as added tokens (as Qwen's own
tokenizer has them) and one BPE token per piece of the passage, and whose
embedding and head are arranged so that each token of the passage predicts the
next. The chain needs every token to occur once, which the markers as single
tokens and a JSON call without spaces allow. Every layer still runs on every
token; the chat template is the demo's, which mlx-lm reads as json_tools.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from worker.shared.demo_model import (
    CHAT_TEMPLATE,
    EMBED_GAIN,
    HEAD_GAIN,
    SPECIAL_TOKENS,
    DemoSpec,
    tokenizer_json,
    write_demo_model,
)

CONTENT = "Checking."
CALL = {"name": "forecast", "arguments": {"days": 3}}
MARKERS = ("<tool_call>", "</tool_call>")
PASSAGE = CONTENT + MARKERS[0] + json.dumps(CALL, separators=(",", ":")) + MARKERS[1]


def write_tool_model(directory: Path, spec: DemoSpec, passage: str = PASSAGE) -> Path:
    return write_chain_model(directory, spec, {"\n": passage})


# An agent's turn: its first answer calls a tool, and once the tool's result is in,
# it answers in words. The template starts the answer after a tool's result with a
# tab, the token the second chain starts from (the model itself still writes every
# token of both answers).
AFTER_TOOL = "\t"
AGENT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if messages[-1]['role'] == 'tool' %}{{- '\t' }}{%- endif %}{%- endif %}",
)


def write_agent_model(directory: Path, spec: DemoSpec, call: str, answer: str) -> Path:
    """A model that answers a chat with `call` (a passage holding a tool call) and a
    chat whose last turn is a tool's result with `answer`."""
    if AGENT_TEMPLATE == CHAT_TEMPLATE:
        raise ValueError("the demo's template changed: AGENT_TEMPLATE no longer applies")
    write_chain_model(directory, spec, {"\n": call, AFTER_TOOL: answer})
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": AGENT_TEMPLATE}))
    return directory


def write_chain_model(directory: Path, spec: DemoSpec, passages: dict[str, str]) -> Path:
    """A demo whose answer after each one-character start is that start's passage."""
    write_demo_model(directory, spec)
    tok = _tokenizer(list(passages.values()))
    (directory / "tokenizer.json").write_text(tok.to_str())
    eos = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    chains = [[ord(start), *tok.encode(passage).ids, eos] for start, passage in passages.items()]
    # Each token has one follower: no token may occur twice (the end aside).
    every = [t for chain in chains for t in chain[:-1]]
    if len(set(every)) != len(every):
        raise ValueError(f"every token of {list(passages.values())!r} must occur once: {chains}")

    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    vocab = tok.get_vocab_size()
    config["vocab_size"] = vocab
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    weights_path = directory / "model.safetensors"
    weights = mx.load(str(weights_path))
    old = np.array(weights["model.embed_tokens.weight"].astype(mx.float32))
    rng = np.random.Generator(np.random.PCG64(spec.seed + 1))
    extra = rng.standard_normal((vocab - old.shape[0], old.shape[1])).astype(np.float32)
    embed = np.concatenate([old, extra])
    directions = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    head = np.zeros_like(embed)
    for chain in chains:
        for current, following in itertools.pairwise(chain):
            head[following] += HEAD_GAIN * directions[current]
    dtype = getattr(mx, spec.dtype)
    weights["model.embed_tokens.weight"] = mx.array(embed * EMBED_GAIN).astype(dtype)
    weights["lm_head.weight"] = mx.array(head).astype(dtype)
    mx.save_safetensors(str(weights_path), weights, metadata={"format": "mlx"})
    return directory


def _tokenizer(passages: list[str]) -> Tokenizer:
    base = json.loads(tokenizer_json())
    vocab: dict[str, int] = dict(base["model"]["vocab"])
    vocab.update({t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    merges: list[tuple[str, str]] = []
    parts = [
        part
        for passage in passages
        for part in passage.replace(MARKERS[0], "\0").replace(MARKERS[1], "\0").split("\0")
    ]
    pieces = [piece for part in parts for piece, _ in pre.pre_tokenize_str(part)]
    # Longest first: the merges that build `":{"` must outrank the one that builds
    # `{"`, or BPE joins the `{"` inside it first and never gets to the whole.
    for piece in sorted(pieces, key=len, reverse=True):
        for k in range(1, len(piece)):
            if (piece[:k], piece[k]) not in merges:
                merges.append((piece[:k], piece[k]))
                vocab[piece[: k + 1]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = Tokenizer.from_str(tokenizer_json()).decoder
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # Not special, as in Qwen's tokenizer: they decode into the text mlx-lm parses.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return tok
