"""Documents → passages → the passages a question needs (pure; one real PDF made here)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from studiotui.chat.documents import Bm25, build_prompt, select_passages, terms
from studiotui.core.documents import DocumentError, Passage, read_document, split_passages

FILLER = (
    "The quarterly review covered routine maintenance of the office and its shared equipment. "
    "Staff discussed schedules, lunch rotations and the usual questions about parking. "
)


def paragraph(seed: int, extra: str = "") -> str:
    # ~100 words, different enough per seed that ranking has something to work with.
    words = (FILLER * 4).split()[:90]
    return " ".join([*words, f"item{seed}", extra]).strip()


def make_pdf(pages: list[list[str]]) -> bytes:
    """A minimal valid PDF: one Helvetica text line per entry, one page per list."""
    objects: list[bytes] = []
    kids: list[str] = []
    font_id = 3
    for i, lines in enumerate(pages):
        page_id, content_id = 4 + 2 * i, 5 + 2 * i
        kids.append(f"{page_id} 0 R")
        ops = ["BT", "/F1 11 Tf", "72 760 Td", "14 TL"]
        for line in lines:
            safe = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"({safe}) Tj T*")
        ops.append("ET")
        stream = zlib.compress("\n".join(ops).encode("latin-1"))
        objects.append(
            f"{page_id} 0 obj << /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 {font_id} 0 R >> >> /Contents {content_id} 0 R >> "
            "endobj\n".encode()
        )
        objects.append(
            f"{content_id} 0 obj << /Length {len(stream)} /Filter /FlateDecode >> stream\n".encode()
            + stream
            + b"\nendstream endobj\n"
        )
    head = [
        b"1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n",
        f"2 0 obj << /Type /Pages /Kids [{' '.join(kids)}] /Count {len(pages)} >> "
        "endobj\n".encode(),
        b"3 0 obj << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> endobj\n",
    ]
    body = b"%PDF-1.4\n"
    offsets = []
    for obj in [*head, *objects]:
        offsets.append(len(body))
        body += obj
    xref = len(body)
    body += f"xref\n0 {len(offsets) + 1}\n0000000000 65535 f \n".encode()
    body += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    body += (
        f"trailer << /Size {len(offsets) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return body


# ---- splitting -------------------------------------------------------------------------


def test_paragraphs_stay_whole_and_nothing_is_lost() -> None:
    text = "\n\n".join(paragraph(i) for i in range(1, 9))
    passages = split_passages("doc.txt", text)
    assert [p.number for p in passages] == list(range(1, len(passages) + 1))
    # ~92-word paragraphs: two do not fit in 150 words, so each is its own passage.
    assert len(passages) == 8
    assert all(f"item{p.number}" in p.text for p in passages)
    assert " ".join(p.text for p in passages).split() == text.split()


def test_short_paragraphs_are_merged_and_headings_start_a_passage() -> None:
    text = "# Intro\n\nshort one.\n\nshort two.\n# Details\nthe details here.\n\nmore."
    passages = split_passages("notes.md", text)
    assert [p.text.splitlines()[0] for p in passages] == ["# Intro", "# Details"]
    assert "short two." in passages[0].text
    assert passages[1].text.endswith("more.")


def test_a_long_paragraph_is_cut_at_sentences() -> None:
    sentences = [f"Sentence number {i} says a few more words here." for i in range(80)]
    passages = split_passages("long.txt", " ".join(sentences))
    assert len(passages) > 2
    assert all(p.words <= 220 for p in passages)
    assert all(p.text.endswith(".") for p in passages)
    # No full stop at all (a PDF page as one line): cut by words.
    blob = " ".join(f"w{i}" for i in range(1000))
    cut = split_passages("blob.txt", blob)
    assert all(p.words <= 220 for p in cut)
    assert " ".join(p.text for p in cut).split() == blob.split()


# ---- reading ---------------------------------------------------------------------------


def test_reads_text_markdown_and_refuses_what_is_not_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("héllo world\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# Title\n\nbody\n")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "d.txt").write_text("   \n")
    assert read_document(tmp_path / "a.txt") == ("text", "héllo world\n")
    assert read_document(tmp_path / "b.md")[0] == "markdown"
    with pytest.raises(DocumentError, match="does not look like text"):
        read_document(tmp_path / "c.bin")
    with pytest.raises(DocumentError, match="empty"):
        read_document(tmp_path / "d.txt")
    with pytest.raises(DocumentError, match=r"missing\.txt does not exist: check the path"):
        read_document(tmp_path / "missing.txt")
    with pytest.raises(DocumentError, match="is a folder: attach one file"):
        read_document(tmp_path)


def test_reads_a_pdf_with_pages(tmp_path: Path) -> None:
    pdf = tmp_path / "report.pdf"
    pdf.write_bytes(
        make_pdf(
            [
                ["Quarterly report (draft)", "Revenue grew in the northern region."],
                ["Appendix", "The zebrafish experiment used 42 tanks."],
            ]
        )
    )
    kind, text = read_document(pdf)
    assert kind == "pdf"
    assert "Revenue grew in the northern region." in text
    assert "zebrafish experiment used 42 tanks" in text
    passages = split_passages("report.pdf", text)
    assert [p.page for p in passages] == [1, 2]
    best = select_passages(passages, "how many zebrafish tanks?", budget_chars=60)
    assert [p.number for p in best.passages] == [2]


def test_a_pdf_without_text_or_broken_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "scan.pdf"
    empty.write_bytes(make_pdf([[]]))
    with pytest.raises(DocumentError, match="scanned"):
        read_document(empty)
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\nthis is not a pdf at all")
    with pytest.raises(DocumentError, match=r"cannot read broken\.pdf"):
        read_document(broken)


# ---- ranking ---------------------------------------------------------------------------


def test_terms_drop_stopwords_and_plurals() -> None:
    assert terms("What are the Zebras of the 42 tanks?") == ["zebra", "42", "tank"]
    assert terms("glass classes") == ["glass", "classe"]


def test_bm25_prefers_rare_words_and_short_passages() -> None:
    passages = [
        Passage("d", 1, "apple apple apple banana"),
        Passage("d", 2, "banana cherry"),
        Passage("d", 3, "banana " * 40 + "cherry"),
    ]
    scores = Bm25(passages).scores("cherry")
    assert scores[0] == 0
    assert scores[1] > scores[2] > 0  # same term, the shorter passage is about it more
    assert Bm25(passages).scores("the of and") == [0.0, 0.0, 0.0]


def doc_with_secrets() -> list[Passage]:
    text = "\n\n".join(
        paragraph(i, "The vault code is tangerine.") if i in (7, 19) else paragraph(i)
        for i in range(1, 31)
    )
    return split_passages("notes.txt", text)


def test_select_picks_the_related_passages_in_document_order() -> None:
    passages = doc_with_secrets()
    chosen = select_passages(passages, "What is the vault code?", budget_chars=3000)
    assert [p.number for p in chosen.passages] == [7, 19]
    assert chosen.matched and not chosen.whole
    assert chosen.used() == [{"document": "notes.txt", "passages": [7, 19]}]
    # A budget for one passage keeps the best one only.
    one = select_passages(passages, "vault code tangerine", budget_chars=800)
    assert len(one.passages) == 1 and one.passages[0].number in (7, 19)


def test_select_sends_a_short_document_whole() -> None:
    passages = split_passages("short.txt", "one.\n\ntwo.\n\nthree.")
    chosen = select_passages(passages, "anything", budget_chars=10_000)
    assert chosen.whole and [p.number for p in chosen.passages] == [1]


def test_unmatched_question_falls_back_to_context_then_to_the_beginning() -> None:
    passages = doc_with_secrets()
    follow_up = select_passages(passages, "and why?", 3000, context_query="the vault code")
    assert [p.number for p in follow_up.passages] == [7, 19]
    nothing = select_passages(passages, "and why?", 2000)
    assert not nothing.matched
    numbers = [p.number for p in nothing.passages]
    assert len(numbers) >= 2 and numbers == list(range(1, len(numbers) + 1))


def test_a_budget_smaller_than_a_passage_sends_what_fits_of_the_best() -> None:
    passages = doc_with_secrets()
    tiny = select_passages(passages, "tangerine", budget_chars=100)
    assert len(tiny.passages) == 1 and len(tiny.passages[0].text) <= 60


def test_prompt_names_each_passage_and_ends_with_the_question() -> None:
    passages = doc_with_secrets()
    chosen = select_passages(passages, "What is the vault code?", budget_chars=3000)
    prompt = build_prompt("What is the vault code?", chosen)
    assert "[notes.txt, passage 7]" in prompt and "[notes.txt, passage 19]" in prompt
    assert "[notes.txt, passage 8]" not in prompt
    assert prompt.endswith("Question: What is the vault code?")
    assert build_prompt("plain", select_passages([], "plain", 100)) == "plain"
