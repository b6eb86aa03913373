"""Structured output's formats as the grammar text that travels (worker/shared/structured.py):
what each API form asks for, and the words and the part named when a schema cannot be
enforced. Pure functions over the real library (llguidance compiles every schema)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from worker.sampling import ParamError, SamplingParams, grammar_tokenizer
from worker.shared.structured import (
    JSON_OBJECT,
    MAX_SCHEMA_BYTES,
    FormatError,
    grammar_problem,
    response_format_grammar,
    schema_grammar,
    text_format_grammar,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def named(schema: Any, **more: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **more}}


def test_each_form_travels_as_its_schema_text() -> None:
    assert response_format_grammar(None) == ""
    assert response_format_grammar({"type": "text"}) == ""
    assert response_format_grammar({"type": "json_object"}) == JSON_OBJECT
    text = response_format_grammar(named(PERSON, strict=True, description="who"))
    assert json.loads(text) == PERSON
    assert " " not in text  # compact: it rides in a ring frame's header
    # The Responses API's text.format keeps the json_schema's fields beside its type.
    flat = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    assert text_format_grammar(flat) == text
    assert text_format_grammar({"type": "json_object"}) == JSON_OBJECT
    # A bare schema (Ollama's format), `true` and a json_schema without one: any JSON.
    assert schema_grammar(PERSON, "format") == text
    assert schema_grammar(True, "format") == "{}"
    assert response_format_grammar(named(None)) == "{}"
    assert grammar_problem(text) == grammar_problem("{}") == ""


@pytest.mark.parametrize(
    ("fmt", "param", "words"),
    [
        ("json", "response_format.type", "must be text, json_object or json_schema"),
        ({"type": "xml"}, "response_format.type", 'got "xml"'),
        ({"type": "json_schema"}, "response_format.json_schema", "must be an object"),
        (
            named(PERSON) | {"json_schema": {"schema": PERSON}},
            "response_format.json_schema.name",
            "1-64",
        ),
        (named(PERSON, strict="yes"), "response_format.json_schema.strict", "true or false"),
        (named(PERSON, description=3), "response_format.json_schema.description", "string"),
        (named([1, 2]), "response_format.json_schema.schema", "must be a JSON Schema object"),
    ],
)
def test_malformed_formats_name_their_field(fmt: Any, param: str, words: str) -> None:
    with pytest.raises(FormatError) as caught:
        response_format_grammar(fmt)
    assert caught.value.param == param
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("schema", "part", "words"),
    [
        # A type that does not exist, deep inside: the path to it.
        (
            {"type": "object",
             "properties": {"tags": {"type": "array", "items": {"type": "strng"}}}},
            ".properties.tags.items",
            "Invalid type: strng",
        ),
        # A pattern the library's regex engine refuses: the caret picture is left out.
        (
            {"type": "object", "properties": {"a": {"type": "object", "properties": {
                "b": {"type": "string", "pattern": "(?<=x)a"}}}}},
            ".properties.a.properties.b",
            "look-around, including look-ahead and look-behind, is not supported",
        ),
        # Keywords it does not implement, in a shared definition.
        (
            {"$defs": {"set": {"type": "array", "uniqueItems": True}},
             "type": "object", "properties": {"s": {"$ref": "#/$defs/set"}}},
            ".$defs.set",
            'Unimplemented keys: ["uniqueItems"]',
        ),
        # A string format it does not know, in an anyOf branch.
        (
            {"anyOf": [{"type": "null"}, {"type": "string", "format": "postcode"}]},
            ".anyOf[1]",
            "Unknown format: postcode",
        ),
        # Bounds no answer can meet, on a property it must have.
        (
            {"type": "object", "required": ["a"],
             "properties": {"a": {"type": "array", "minItems": 5, "maxItems": 2}}},
            ".properties.a",
            "minItems (5) is greater than maxItems (2)",
        ),
        # Only the whole is wrong: the schema itself is named.
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "", "incompatible types"),
        ({"$ref": "#/$defs/missing"}, "", "does not exist"),
    ],
)  # fmt: skip
def test_a_schema_the_library_cannot_compile_names_the_part(
    schema: dict[str, Any], part: str, words: str
) -> None:
    with pytest.raises(FormatError) as caught:
        response_format_grammar(named(schema))
    where = "response_format.json_schema.schema" + part
    assert caught.value.param == where
    assert str(caught.value).startswith(f"{where} cannot be enforced: ")
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_schema_too_large_for_the_ring_is_refused_by_its_size() -> None:
    big = {"enum": ["x" * 1000 for _ in range(MAX_SCHEMA_BYTES // 1000 + 1)]}
    with pytest.raises(FormatError) as caught:
        schema_grammar(big, "format")
    assert caught.value.param == "format"
    assert f"at most {MAX_SCHEMA_BYTES} are enforced" in str(caught.value)


def test_the_schema_travels_in_the_sampling_params() -> None:
    text = schema_grammar(PERSON, "format")
    params = SamplingParams.from_dict({"grammar": text, "temperature": 1.0})
    assert params.grammar == text
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ParamError, match="grammar must be JSON Schema text"):
        SamplingParams.from_dict({"grammar": 5})


def test_a_tokenizer_the_library_cannot_read_is_refused_in_words() -> None:
    with pytest.raises(ParamError) as caught:
        grammar_tokenizer(object(), 300)
    assert str(caught.value).startswith("response_format cannot be enforced for this model")
