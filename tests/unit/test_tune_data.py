"""tune/data.py: the formats mlx-lm takes, bad lines named, documents, the deal per rank."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from studiotui.tune.data import (
    DataError,
    Examples,
    check_counts,
    deal,
    example_format,
    load_examples,
    write_shares,
)
from tests.unit.test_documents import make_pdf


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_three_formats_mlx_lm_reads() -> None:
    assert example_format({"messages": [{"role": "user", "content": "hi"}]}) == "chat"
    assert example_format({"prompt": "a", "completion": "b"}) == "completions"
    assert example_format({"text": "words"}) == "text"
    for bad in ({"text": ""}, {"messages": [{"content": "x"}]}, {"prompt": "a"}, [1], "x"):
        assert example_format(bad) is None


def test_a_bad_line_is_named_file_colon_line(tmp_path: Path) -> None:
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, {"prompt": "p", "completion": "c"}])
    with pytest.raises(DataError, match=rf"{mixed}:2: a completions example in a file of text"):
        load_examples(mixed)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match=rf"{broken}:2: not JSON"):
        load_examples(broken)
    with pytest.raises(DataError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")
    (tmp_path / "notes.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"not a \.jsonl file"):
        load_examples(tmp_path / "notes.csv")


def test_mlx_lm_data_folder_keeps_its_valid_set(tmp_path: Path) -> None:
    _jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}"} for i in range(10)])
    _jsonl(tmp_path / "valid.jsonl", [{"text": "v"}] * 3)
    got = load_examples(tmp_path)
    assert (len(got.train), len(got.valid), got.held_out) == (10, 3, False)


def test_a_folder_of_documents_becomes_text_examples(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.md").write_text("# Title\n\n" + "word " * 400)
    (docs / "sub" / "b.txt").write_text("plain text " * 50)
    (docs / "c.pdf").write_bytes(make_pdf([["page one text here"], ["page two text"]]))
    (docs / "skip.bin").write_bytes(b"\0\1")
    got = load_examples(docs, least=2)
    rows = [*got.train, *got.valid]
    assert got.format == "text" and len(got.valid) == 2
    text = " ".join(r["text"] for r in rows)
    assert "Title" in text and "plain text" in text and "page two text" in text
    # Passages of the chat's size (~150 words), not whole files.
    assert max(len(r["text"].split()) for r in rows) <= 220
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no \.jsonl, text, Markdown or PDF"):
        load_examples(tmp_path / "empty")


def test_each_global_batch_is_dealt_over_the_ranks() -> None:
    rows = [{"text": "x" * (i % 7 + 1) + str(i)} for i in range(21)]
    one = deal(rows, 4, 1)[0]
    two = deal(rows, 4, 2)
    assert len(one) == 20 and [len(r) for r in two] == [10, 10]  # the partial batch dropped
    for b in range(5):  # rank r's local batch b + the other's = one node's batch b
        assert sorted(map(str, two[0][2 * b : 2 * b + 2] + two[1][2 * b : 2 * b + 2])) == sorted(
            map(str, one[4 * b : 4 * b + 4])
        )


def test_counts_are_checked_against_the_group(tmp_path: Path) -> None:
    ex = Examples("d", "text", tuple({"text": "t"} for _ in range(6)), ({"text": "v"},) * 4)
    check_counts(ex, 4, 2)
    with pytest.raises(DataError, match="split evenly over 3 nodes"):
        check_counts(ex, 4, 3)
    with pytest.raises(DataError, match="fewer than one batch of 8"):
        check_counts(ex, 8, 2)
    # One of a thing is said as one: "1 training example", "on 1 node".
    one = Examples("d", "text", ({"text": "t"},), ())
    with pytest.raises(DataError, match=r"gives 1 training example, .* on 1 node\)"):
        check_counts(one, 2, 1)
    with pytest.raises(DataError, match="gives 1 validation example, "):
        check_counts(replace(ex, valid=({"text": "v"},)), 4, 2)
    names = write_shares(tmp_path, deal(ex.train, 4, 2), [[ex.valid[0]], [ex.valid[1]]])
    assert names == [
        "rank0.train.jsonl",
        "rank0.valid.jsonl",
        "rank1.train.jsonl",
        "rank1.valid.jsonl",
    ]
    assert len((tmp_path / "rank1.train.jsonl").read_text().splitlines()) == 2
