"""Documents attached to a conversation: which of their passages go into a prompt.

A document (read and cut into passages by `core.documents`) that fits in the prompt
goes in whole. Of a longer one the passages most related to the question are chosen
with BM25 over words: a plain, local, explainable ranking. Nothing here talks to the
network; the text of a document never leaves the operator's machine except as part
of a prompt to the cluster's own shards.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studiotui.core.documents import Passage

# Passages scoring below this share of the best are left out even when they would
# fit: they share a common word with the question and little else.
RELATIVE_CUTOFF = 0.2
BM25_K1 = 1.2
BM25_B = 0.75

# Small on purpose: the words that say nothing about which passage is meant.
_STOPWORDS = """a an and are as at be been but by can could did do does for from had has have how i
    if in into is it its me my no not of on or our she so than that the their them then
    there these they this those to was we were what when where which who why will with
    would you your he his her about also any all more most other some such only own same
    should just very"""
STOPWORDS = frozenset(_STOPWORDS.split())


@dataclass(frozen=True)
class Selection:
    passages: tuple[Passage, ...]  # in document order
    whole: bool  # every passage of every document fit: nothing was chosen
    matched: bool  # the question shared words with some passage

    def used(self) -> list[dict[str, Any]]:
        """Per document, the passage numbers that went into the prompt (for history meta)."""
        by_doc: dict[str, list[int]] = {}
        for p in self.passages:
            by_doc.setdefault(p.document, []).append(p.number)
        return [{"document": d, "passages": sorted(n)} for d, n in by_doc.items()]


# ---- sizes in tokens -----------------------------------------------------------------

# Ordinary prose with numbers and punctuation, to measure a tokenizer on.
_SAMPLE = (
    "The quarterly report covers revenue, hiring and the migration of 14 servers to the "
    "new data centre. Costs rose by 3.5% while the support team answered 1,240 tickets; "
    "the audit found two expired certificates and recommended rotating keys every 90 days. "
    "Next quarter: finish the migration, hire three engineers and review the budget."
)


@functools.lru_cache(maxsize=16)
def local_chars_per_token(model_dir: str) -> float | None:
    """Characters per token of the model's own tokenizer, when its files are on this
    machine (a local cluster, or a model placed from the operator's models folder);
    None otherwise. The tokenizer is only read here: nothing is sent anywhere."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        tokens = len(Tokenizer.from_file(str(path)).encode(_SAMPLE).ids)
    except Exception:  # missing, unreadable or not a tokenizers file: estimate instead
        return None
    return len(_SAMPLE) / tokens if tokens else None


# ---- ranking -------------------------------------------------------------------------


def terms(text: str) -> list[str]:
    """Words for ranking: lower case, no stopwords, a plural 's' dropped."""
    out = []
    for word in re.findall(r"\w+", text.lower()):
        if word in STOPWORDS or (len(word) < 2 and not word.isdigit()):
            continue
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        out.append(word)
    return out


class Bm25:
    """Okapi BM25 over a fixed list of passages."""

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages
        self.counts = [Counter(terms(p.text)) for p in passages]
        self.lengths = [sum(c.values()) for c in self.counts]
        n = len(passages)
        self.avg = (sum(self.lengths) / n) if n else 0.0
        df: Counter[str] = Counter()
        for c in self.counts:
            df.update(c.keys())
        self.idf = {t: math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: str) -> list[float]:
        wanted = set(terms(query))
        out = []
        for counts, length in zip(self.counts, self.lengths, strict=True):
            norm = BM25_K1 * (1.0 - BM25_B + BM25_B * length / self.avg) if self.avg else BM25_K1
            score = 0.0
            for t in wanted:
                tf = counts.get(t, 0)
                if tf:
                    score += self.idf[t] * tf * (BM25_K1 + 1.0) / (tf + norm)
            out.append(score)
        return out


def select_passages(
    passages: list[Passage], question: str, budget_chars: int, context_query: str = ""
) -> Selection:
    """The passages to put in the prompt, in document order, within `budget_chars`.

    `context_query` (e.g. the previous question) is tried when the question alone
    matches nothing, so a follow-up such as "and why?" still finds its passage.
    """
    if not passages:
        return Selection((), whole=True, matched=False)
    total = sum(len(p.text) for p in passages)
    if total <= budget_chars:
        return Selection(tuple(passages), whole=True, matched=True)
    index = Bm25(passages)
    scores = index.scores(question)
    if max(scores) <= 0 and context_query:
        scores = index.scores(f"{question} {context_query}")
    best = max(scores)
    if best <= 0:
        # Nothing in common with the question: say so and give the beginning.
        chosen = _fill(list(range(len(passages))), passages, budget_chars)
        return Selection(_in_order(chosen, passages), whole=False, matched=False)
    ranked = sorted(
        (i for i, s in enumerate(scores) if s >= best * RELATIVE_CUTOFF),
        key=lambda i: (-scores[i], i),
    )
    chosen = _fill(ranked, passages, budget_chars)
    return Selection(_in_order(chosen, passages), whole=False, matched=True)


def _fill(order: list[int], passages: list[Passage], budget: int) -> list[Passage]:
    chosen: list[Passage] = []
    used = 0
    for i in order:
        size = len(passages[i].text) + 40  # the passage's header line
        if used + size <= budget:
            chosen.append(passages[i])
            used += size
    if not chosen:
        # Not even the best passage fits the budget: send what fits of it.
        first = passages[order[0]]
        cut = max(0, budget - 40)
        chosen.append(Passage(first.document, first.number, first.text[:cut], first.page))
    return chosen


def _in_order(chosen: list[Passage], passages: list[Passage]) -> tuple[Passage, ...]:
    rank = {(p.document, p.number): i for i, p in enumerate(passages)}
    return tuple(sorted(chosen, key=lambda p: rank[(p.document, p.number)]))


def build_prompt(question: str, selection: Selection) -> str:
    """The user message the model sees: the passages, then the question."""
    if not selection.passages:
        return question
    names = sorted({p.document for p in selection.passages})
    if selection.whole:
        intro = f"The attached document{'s' if len(names) > 1 else ''} ({', '.join(names)}), "
        intro += "in numbered passages:"
    elif selection.matched:
        intro = (
            f"Passages from {', '.join(names)} that relate to the question "
            "(numbered as in the document; the rest was left out):"
        )
    else:
        intro = (
            f"No passage of {', '.join(names)} shares words with the question; "
            "here is how the document begins:"
        )
    blocks = []
    for p in selection.passages:
        where = f", page {p.page}" if p.page else ""
        blocks.append(f"[{p.document}, passage {p.number}{where}]\n{p.text}")
    return (
        f"{intro}\n\n"
        + "\n\n".join(blocks)
        + "\n\nAnswer from these passages where they help and name the passage numbers you "
        "used.\n\nQuestion: " + question
    )
