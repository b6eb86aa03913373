"""Structured output: a client's answer format as the grammar the tail shard enforces.

Pure translation and checking, importable by the operator side: the API calls
`response_format_grammar` (OpenAI's `response_format`), `text_format_grammar` (the
Responses API's `text.format`) or `schema_grammar` (a bare JSON Schema, as Ollama's
`format` sends one) on the request it parses, and refuses a format the grammar library
cannot compile with a 400 naming the part of the schema, before anything reaches the
cluster. What they return travels in the request's sampling parameters
(`SamplingParams.grammar`, worker/sampling.py): the schema as compact JSON text, from
which the tail compiles the same grammar with `compile_grammar` and masks every token
it draws with it.

The library is llguidance (see docs/structured-output.md for why): a JSON Schema
compiles to a grammar whose token mask is computed lazily per step in Rust, with no
dependency beyond itself.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher

if TYPE_CHECKING:  # its stub's name for the options; not in the module at run time
    from llguidance._lib import JsonCompileOptions

# The schema rides in a ring frame's header (RING_HEADER_BYTES, 256 KiB, also holds the
# stop strings and the penalties' window); no hand-written schema comes near this.
MAX_SCHEMA_BYTES = 64 * 1024
# What `response_format: {"type": "json_object"}` asks for: any JSON object.
JSON_OBJECT = '{"type":"object"}'
# OpenAI's rule for a json_schema's name.
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Whitespace between JSON's tokens: none, one space, or a newline and an indent of up to
# 20 (llama.cpp's JSON grammars allow the same). Unbounded whitespace lets a model
# write newlines for ever inside a valid answer, a known failure of JSON modes.
WHITESPACE = r"(?:\x20|\n[\x20\t]{0,20})?"
# llguidance's JSON compiler options, the same on both sides (API check, tail).
OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE}
# Schema keywords whose values are schemas (one, a list, or a map of them): where a
# fault is looked for when the whole schema does not compile.
_ONE = (
    *("additionalProperties", "items", "not", "contains", "propertyNames", "if", "then"),
    *("else", "unevaluatedProperties", "unevaluatedItems", "additionalItems"),
)
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_MAPS = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")


class FormatError(ValueError):
    """A format that cannot be enforced: `param` names its part (a path into the
    request, such as `response_format.json_schema.schema.properties.age`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def response_format_grammar(fmt: Any, param: str = "response_format") -> str:
    """OpenAI's chat/completions `response_format` as the grammar text that travels
    ("" for plain text): `{"type": "text"}`, `{"type": "json_object"}`, or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`."""
    if fmt is None:
        return ""
    kind = _kind(fmt, param)
    if kind in ("text", "json_object"):
        return "" if kind == "text" else JSON_OBJECT
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError(
            f"{param}.json_schema must be an object "
            '{"name": ..., "schema": {...}, "strict": true}',
            f"{param}.json_schema",
        )
    return _named_schema(spec, f"{param}.json_schema")


def text_format_grammar(fmt: Any, param: str = "text.format") -> str:
    """The Responses API's `text.format`: as `response_format`, with the json_schema's
    fields beside its type (`{"type": "json_schema", "name", "schema", "strict"}`)."""
    if fmt is None:
        return ""
    kind = _kind(fmt, param)
    if kind in ("text", "json_object"):
        return "" if kind == "text" else JSON_OBJECT
    return _named_schema(fmt, param)


def schema_grammar(schema: Any, param: str) -> str:
    """A bare JSON Schema (an object; `true` for any JSON value) as the grammar text
    that travels, checked by compiling it."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise FormatError(f"{param} must be a JSON Schema object", param)
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{param} is not JSON: {exc}", param) from None
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise FormatError(
            f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are enforced: "
            "shorten the schema (share repeated parts through $defs and $ref)",
            param,
        )
    if problem := grammar_problem(text):
        where, message = _locate(schema, problem)
        at = param + "".join(f".{step}" for step in where)
        raise FormatError(f"{at} cannot be enforced: {message}", at)
    return text


def compile_grammar(text: str) -> str:
    """The llguidance grammar for the schema text a request carries (as built by the
    functions above); `grammar_problem` says whether the library accepts it."""
    return LLMatcher.grammar_from_json_schema(text, overrides=OPTIONS)


def grammar_problem(text: str) -> str:
    """What llguidance says is wrong with the schema text, in one line ("" if nothing)."""
    try:
        failed, messages = LLMatcher.validate_grammar_with_warnings(compile_grammar(text))
    except ValueError as exc:  # not a JSON object at all
        return _one_line(str(exc))
    return _one_line(messages[0]) if failed and messages else ""


def _kind(fmt: Any, param: str) -> str:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        got = json.dumps(kind) if isinstance(kind, str) else "no type"
        raise FormatError(
            f"{param}.type must be text, json_object or json_schema; got {got[:80]}",
            f"{param}.type",
        )
    return str(kind)


def _named_schema(spec: dict[str, Any], param: str) -> str:
    """A json_schema's fields, OpenAI's way: a name of letters, digits, _ and -, an
    optional description, strict true or false (the schema is enforced either way),
    and the schema (none: any JSON value)."""
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise FormatError(
            f"{param}.name must be 1-64 letters, digits, _ or -, naming the format",
            f"{param}.name",
        )
    if not isinstance(spec.get("description", ""), str):
        raise FormatError(f"{param}.description must be a string", f"{param}.description")
    if not isinstance(spec.get("strict", False), bool | None):
        raise FormatError(f"{param}.strict must be true or false", f"{param}.strict")
    schema = spec.get("schema")
    return schema_grammar({} if schema is None else schema, f"{param}.schema")


def _locate(schema: dict[str, Any], problem: str) -> tuple[list[str], str]:
    """The deepest part of `schema` that fails alone, and the library's words for it
    (its message names no place): the part failing with the same words as the whole,
    or else the only part that fails (an unsatisfiable required property fails its
    object with words of its own). Each part is compiled with the root's
    $defs/definitions beside it, so its references still resolve."""
    shared = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    where: list[str] = []
    node: Any = schema
    while True:
        failing: list[tuple[str, Any, str]] = []
        for step, child in _children(node):
            if not isinstance(child, dict) or child is node:
                continue
            alone = json.dumps({**shared, **child}, separators=(",", ":"), default=str)
            if words := grammar_problem(alone):
                failing.append((step, child, words))
                if words == problem:
                    break
        same = [each for each in failing if each[2] == problem]
        if not same and len(failing) != 1:
            return where, problem
        step, node, problem = (same or failing)[0]
        where.append(step)


def _children(node: dict[str, Any]) -> list[tuple[str, Any]]:
    """The schemas inside a schema, each with the path step that reaches it."""
    out: list[tuple[str, Any]] = []
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out += [(f"{key}.{name}", child) for name, child in node[key].items()]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            out += [(f"{key}[{i}]", child) for i, child in enumerate(node[key])]
    out += [(key, node[key]) for key in _ONE if isinstance(node.get(key), dict)]
    return out


def _one_line(message: str) -> str:
    """llguidance's message on one line: a regex error's caret picture is dropped, its
    last line ("error: unclosed character class") kept."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1].startswith("error:"):
        return f"{lines[0]} {lines[-1].removeprefix('error:').strip()}"
    return " ".join(lines)
