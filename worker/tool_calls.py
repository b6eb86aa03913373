"""Tool calls in an answer, told apart from its text on the head shard.

mlx-lm knows each family's tool-call format: `load_tokenizer` infers it from the
chat template and gives the tokenizer its markers (`tool_call_start`,
`tool_call_end`) and its parser (`mlx_lm/tool_parsers/`). This splits the
streaming text the way `mlx_lm.server` does, with mlx-lm's own `TextStateMachine`:
text between the markers is held back and handed to the parser when the call
closes, everything else is the answer's content. Only the tool transitions are
used: a thinking model's `<think>` text stays in the content, as it does without
tools.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.generate import TextStateMachine

NORMAL, TOOL = "normal", "tool"


def supports_tools(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))


class ToolCallStream:
    """Feeds on an answer's text; gives back its content and its parsed tool calls."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self._parse = tokenizer.tool_parser
        self._tools = tools
        self._start = tokenizer.tool_call_start
        # Some formats (mistral's [TOOL_CALLS]) have no end marker: the calls run to
        # the end of the answer.
        self._end = tokenizer.tool_call_end or ""
        machine = TextStateMachine(
            {NORMAL: [(self._start, TOOL)], TOOL: [(self._end, NORMAL)] if self._end else []}
        )
        self._state = machine.make_state(NORMAL)
        self._current = NORMAL
        self._call_text = ""
        self.calls = 0

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content `text` adds, and the calls it closes."""
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._take(segments)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is still held back when the answer ends: a marker's beginning is text,
        an unclosed call is parsed as it stands (a format without an end marker)."""
        self._state, rest, current = TextStateMachine.flush(self._state)
        content, calls = self._take([(current, rest)])
        if self._current == TOOL:
            more_content, more_calls = self._close(closed=False)
            content, calls = content + more_content, calls + more_calls
            self._current = NORMAL
        return content, calls

    def _take(self, segments: list[tuple[str | None, str]]) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for state, text in segments:
            if state == TOOL:
                self._call_text += text
            else:
                if self._current == TOOL:
                    more_content, more_calls = self._close(closed=True)
                    content.append(more_content)
                    calls.extend(more_calls)
                content.append(text)
            self._current = state if state is not None else NORMAL
        return "".join(content), calls

    def _close(self, closed: bool) -> tuple[str, list[dict[str, Any]]]:
        text, self._call_text = self._call_text, ""
        try:
            parsed = self._parse(text, self._tools)
            calls = [_checked(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except Exception:
            # The parsers raise what they like on text they cannot read (a call cut
            # off by max_tokens, a model that got the format wrong). The client gets
            # the text back as content rather than nothing.
            return self._start + text + (self._end if closed else ""), []
        self.calls += len(calls)
        return "", calls


def _checked(call: Any) -> dict[str, Any]:
    """A parsed call as it travels: a name and JSON arguments (an object, as a rule)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f"a tool call needs a name: {call!r}")
    out = {"name": call["name"], "arguments": call.get("arguments", {})}
    json.dumps(out["arguments"])  # it must survive the trip to the client as JSON
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]  # some formats carry the model's own call id
    return out
