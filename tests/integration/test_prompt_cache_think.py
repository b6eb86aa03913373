"""The prefix cache under a chat template that drops earlier turns' reasoning, as
Qwen3's does: turn 1's prompt ends in an (empty) `<think>` block the model answers
after, and turn 2 renders that answer without it, so turn 2's prompt is not an
extension of turn 1's prompt and answer; it branches off inside turn 1's prompt. The
ring must still answer as mlx-lm's `generate_step` does on each prompt, and reuse the
prefix the two share (cut back out of turn 1's entry), no more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer

from tests.support.ring_harness import CHUNK, InProcessRing
from worker.shared.demo_model import DemoSpec, write_demo_model

# Qwen3's rule in short: an assistant turn of the history keeps only what follows its
# `</think>`; the generation prompt opens an empty think block (thinking turned off).
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
)
N = 6
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
ASK_1 = {"role": "user", "content": "What is two and two?"}
ASK_2 = {"role": "user", "content": "And three and three?"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(arch="llama", dtype="float32", seed=3, layers=4, hidden=64, heads=4, kv_heads=2)
    path = write_demo_model(tmp_path_factory.mktemp("think") / "m", spec)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINK_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


def _ask(ring: InProcessRing, rid: str, messages: list[dict[str, str]]) -> tuple[list[int], int]:
    ring.stages[0].submit(b"c", {"rid": rid, "params": GREEDY, "messages": messages})
    ring.drain()
    [done] = [f for k, f in ring.client if k == "done" and f["rid"] == rid]
    return ring.tokens(rid), done["usage"]["cached_tokens"]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", [[(0, 4)], [(0, 2), (2, 4)]], ids=["1-stage", "2-stages"])
def test_a_turn_whose_template_drops_the_reasoning_reuses_the_shared_prefix(
    model: Path, split: list[tuple[int, int]]
) -> None:
    tokenizer = load_tokenizer(model)
    loaded, _ = mlx_lm.load(str(model))

    def reference(prompt: list[int]) -> list[int]:
        steps = generate_step(mx.array(prompt), loaded, max_tokens=N, prefill_step_size=CHUNK)
        return [int(t) for t, _ in steps]

    def prompt_of(messages: list[dict[str, Any]]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    ring = InProcessRing(model, split)
    turn_1 = [SYSTEM, ASK_1]
    answer_1, cached_1 = _ask(ring, "t1", turn_1)
    prompt_1 = prompt_of(turn_1)
    assert (answer_1, cached_1) == (reference(prompt_1), 0)

    # The client sends the answer back as the model wrote it, reasoning and all; the
    # template keeps only what follows `</think>`.
    said = "<think>\nTwo and two.\n</think>\n\n" + tokenizer.decode(answer_1)
    turn_2 = [*turn_1, {"role": "assistant", "content": said}, ASK_2]
    prompt_2 = prompt_of(turn_2)
    stored = prompt_1 + answer_1
    shared = _common(stored, prompt_2)
    # Not an extension: the prompts part inside turn 1's prompt (at its think block).
    assert shared < len(prompt_1) and prompt_2[: len(prompt_1)] != prompt_1
    answer_2, cached_2 = _ask(ring, "t2", turn_2)
    assert answer_2 == reference(prompt_2)
    assert cached_2 == shared > 0  # the shared prefix cut out of turn 1's entry

    # Turn 3 extends turn 2's prompt and answer as the template renders them: the whole
    # history but the last token is reused, and the tokens stay mlx-lm's.
    turn_3 = [
        *turn_2,
        {"role": "assistant", "content": tokenizer.decode(answer_2)},
        {"role": "user", "content": "Thanks."},
    ]
    prompt_3 = prompt_of(turn_3)
    answer_3, cached_3 = _ask(ring, "t3", turn_3)
    assert answer_3 == reference(prompt_3)
    assert cached_3 == _common(prompt_2 + answer_2, prompt_3) > shared
    # A ring that never saw the conversation answers turn 2 the same.
    cold = InProcessRing(model, split)
    assert _ask(cold, "t2", turn_2) == (answer_2, 0)
