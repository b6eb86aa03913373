"""Training data for a fine-tuning job: read, checked, split, and dealt out per rank.

Accepted, as mlx-lm's own datasets take them (`mlx_lm.tuner.datasets.create_dataset`,
which picks the format from the first example):
* a `.jsonl` file of chat (`{"messages": [...]}`), completions (`{"prompt", "completion"}`)
  or text (`{"text"}`) examples, one per line; or a folder holding mlx-lm's
  `train.jsonl` (and `valid.jsonl`);
* a folder of the user's documents (text, Markdown, PDF, read by the chat's own
  readers) whose passages become `{"text"}` examples.

Every line is checked here, before anything is copied or loaded: a bad line is named
as `file:line`. The validation share is held out (unless `valid.jsonl` is given), and
each global batch of the training set is dealt over the ranks (`deal`) so each node
gets a file of only its own examples (worker/finetune.py explains why the ranks then
train on the same global batches as one node would).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studiotui.core.documents import TEXT_SUFFIXES, DocumentError, read_document, split_passages
from studiotui.core.errors import StudioError
from studiotui.core.text import counted

VALID_SHARE = 0.1
DOC_SUFFIXES = (TEXT_SUFFIXES - {""}) | {".pdf"}
FORMATS = ("chat", "completions", "text")


class DataError(StudioError, ValueError):
    pass


@dataclass(frozen=True)
class Examples:
    source: str  # what the user named
    format: str  # chat, completions, text
    train: tuple[dict[str, Any], ...]
    valid: tuple[dict[str, Any], ...] = ()
    held_out: bool = False  # valid was taken from train here (not given)


def example_format(row: Any) -> str | None:
    """mlx-lm's format of one example, in its order of preference; None if none."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return "completions"
    messages = row.get("messages")
    if isinstance(messages, list) and messages:
        ok = all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages
        )
        return "chat" if ok else None
    if isinstance(row.get("text"), str) and row["text"].strip():
        return "text"
    return None


def read_jsonl(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """The examples of one JSONL file and their one format; DataError names file:line."""
    rows: list[dict[str, Any]] = []
    first: str | None = None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(
                f"{where}: not JSON ({exc.args[0]})", "one JSON object a line"
            ) from None
        kind = example_format(row)
        if kind is None:
            raise DataError(
                f"{where}: not a training example",
                'use {"messages": [{"role": ..., "content": ...}, ...]}, '
                '{"prompt": ..., "completion": ...} or {"text": ...}',
            )
        if first is None:
            first = kind
        elif kind != first:
            raise DataError(
                f"{where}: a {kind} example in a file of {first} examples",
                "keep one format per file (mlx-lm reads every example as the first one)",
            )
        rows.append(row)
    if first is None:
        raise DataError(f"{path} holds no examples")
    return first, rows


def read_documents(folder: Path) -> list[dict[str, Any]]:
    """Passages of every text, Markdown and PDF file under `folder`, as text examples."""
    rows: list[dict[str, Any]] = []
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in DOC_SUFFIXES)
    if not files:
        raise DataError(
            f"{folder} holds no .jsonl, text, Markdown or PDF files",
            "give a JSONL file, mlx-lm's data folder (train.jsonl, valid.jsonl) or documents",
        )
    for path in files:
        try:
            _, text = read_document(path)
        except DocumentError as exc:
            raise DataError(f"{path}: {exc}") from None
        name = str(path.relative_to(folder))
        rows.extend({"text": p.text} for p in split_passages(name, text))
    return rows


def hold_out(
    rows: Sequence[dict[str, Any]], share: float, seed: int, least: int = 1
) -> tuple[list, list]:
    """(train, valid): a seeded random `share` of the examples held out, and at least
    `least` (one validation batch) when that leaves as many to train on."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_valid = max(least, round(len(rows) * share))
    if len(rows) - n_valid < n_valid:
        n_valid = max(1, round(len(rows) * share)) if len(rows) > 1 else 0
    valid = {i for i in order[:n_valid]}
    return [r for i, r in enumerate(rows) if i not in valid], [rows[i] for i in sorted(valid)]


def load_examples(
    source: Path, seed: int = 0, share: float = VALID_SHARE, least: int = 1
) -> Examples:
    """The examples `source` gives, with a validation set (of at least `least` when
    held out here)."""
    source = source.expanduser()
    if not source.exists():
        raise DataError(f"training data {source} does not exist")
    if source.is_file():
        if source.suffix.lower() != ".jsonl":
            raise DataError(
                f"{source} is not a .jsonl file", "give JSONL, or a folder of documents"
            )
        kind, rows = read_jsonl(source)
        train, valid = hold_out(rows, share, seed, least)
        return Examples(str(source), kind, tuple(train), tuple(valid), held_out=True)
    if (source / "train.jsonl").is_file():
        kind, train = read_jsonl(source / "train.jsonl")
        if (source / "valid.jsonl").is_file():
            vkind, valid = read_jsonl(source / "valid.jsonl")
            if vkind != kind:
                raise DataError(f"{source}/valid.jsonl holds {vkind} examples, train.jsonl {kind}")
            return Examples(str(source), kind, tuple(train), tuple(valid))
        held, valid = hold_out(train, share, seed, least)
        return Examples(str(source), kind, tuple(held), tuple(valid), held_out=True)
    train, valid = hold_out(read_documents(source), share, seed, least)
    return Examples(str(source), "text", tuple(train), tuple(valid), held_out=True)


def check_counts(examples: Examples, batch_size: int, size: int) -> None:
    """Refuse data too small for the group (before anything is copied or loaded)."""
    if batch_size < size or batch_size % size:
        raise DataError(
            f"a batch of {batch_size} cannot be split evenly over {size} nodes",
            f"use a --batch-size that is a multiple of {size}",
        )
    if len(examples.train) < batch_size:
        raise DataError(
            f"{examples.source} gives {counted(len(examples.train), 'training example')}, "
            f"fewer than one batch of {batch_size} ({batch_size // size} per node on "
            f"{counted(size, 'node')})",
            "add examples or lower --batch-size",
        )
    if examples.valid and len(examples.valid) < batch_size:
        raise DataError(
            f"{examples.source} gives {counted(len(examples.valid), 'validation example')}, "
            f"fewer than one batch of {batch_size}",
            "add examples (or a valid.jsonl) or lower --batch-size",
        )


def deal(rows: Sequence[dict[str, Any]], batch_size: int, size: int) -> list[list[dict]]:
    """Each rank's examples: global batch b is examples [b*B, (b+1)*B) (sorted by length,
    as mlx-lm groups similar lengths to pad less), and rank r takes every size-th one of
    it. A last partial batch is dropped, as mlx-lm's batching drops it."""
    # By number of keys first: mlx-lm's batching sorts a rank's examples by that (the
    # len() of a raw example), so each rank's file must already be in that order.
    ordered = sorted(rows, key=lambda r: (len(r), len(json.dumps(r))))
    whole = len(ordered) // batch_size * batch_size
    return [ordered[r:whole:size] for r in range(size)]


def deal_valid(rows: Sequence[dict[str, Any]], size: int) -> list[list[dict]]:
    """Validation examples spread over the ranks (their losses are summed over the group)."""
    return [list(rows[r::size]) for r in range(size)]


def write_shares(folder: Path, train: list[list[dict]], valid: list[list[dict]]) -> list[str]:
    """rank<i>.train.jsonl / rank<i>.valid.jsonl in `folder`; the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for rank, (t, v) in enumerate(zip(train, valid, strict=True)):
        for part, rows in (("train", t), ("valid", v)):
            name = f"rank{rank}.{part}.jsonl"
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            (folder / name).write_text(text, encoding="utf-8")
            names.append(name)
    return names
