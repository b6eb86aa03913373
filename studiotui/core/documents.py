"""Reading a document (text, Markdown or PDF) and cutting it into numbered passages:
what a chat's attached documents and a fine-tuning's training files both start from.

A passage is about PASSAGE_WORDS words: paragraphs kept together where they fit, a
Markdown heading starting a new one, a long paragraph cut at sentences, and a PDF's
passage kept on one page so "page N" is exact. Nothing here talks to the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from studiotui.core.errors import StudioError

PASSAGE_WORDS = 150
MAX_PASSAGE_WORDS = 220
MAX_FILE_BYTES = 50 * 1024 * 1024
PAGE_BREAK = "\f"

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text", ""}


class DocumentError(StudioError, ValueError):
    pass


@dataclass(frozen=True)
class Passage:
    document: str
    number: int  # 1-based, in document order
    text: str
    page: int | None = None  # PDF page it starts on

    @property
    def words(self) -> int:
        return len(self.text.split())


# ---- reading -------------------------------------------------------------------------


def read_document(path: Path) -> tuple[str, str]:
    """(kind, text) of a text, Markdown or PDF file; DocumentError says why not."""
    path = path.expanduser()
    if not path.exists():
        raise DocumentError(f"{path} does not exist: check the path")
    if path.is_dir():
        raise DocumentError(f"{path} is a folder: attach one file (text, Markdown or PDF)")
    if not path.is_file():
        raise DocumentError(f"{path} is not a file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise DocumentError(f"{path.name} is {size / 1e6:.0f} MB; the limit is 50 MB")
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return "pdf", _read_pdf(path)
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise DocumentError(f"{path.name} does not look like text: attach text, Markdown or PDF")
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        raise DocumentError(f"{path.name} is empty")
    kind = "markdown" if suffix in (".md", ".markdown") else "text"
    return kind, text


def _read_pdf(path: Path) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError
    except ImportError:  # pragma: no cover - pypdf is a dependency
        raise DocumentError("reading PDF needs the pypdf package") from None
    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{path.name} is encrypted with a password")
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PdfReadError, ValueError, KeyError, OSError) as exc:
        raise DocumentError(f"cannot read {path.name} as PDF: {exc}") from None
    if not any(p.strip() for p in pages):
        raise DocumentError(
            f"no text in {path.name}: a scanned PDF holds pictures of pages, not text"
        )
    # Pages are kept apart so passages can say where they start.
    return PAGE_BREAK.join(pages)


# ---- passages ------------------------------------------------------------------------


def split_passages(
    name: str, text: str, target_words: int = PASSAGE_WORDS, max_words: int = MAX_PASSAGE_WORDS
) -> list[Passage]:
    pages = text.split(PAGE_BREAK)
    numbered = len(pages) > 1
    chunks: list[tuple[str, int | None]] = []
    current: list[str] = []
    current_words = 0
    current_page: int | None = None

    def flush() -> None:
        nonlocal current, current_words
        if current:
            chunks.append(("\n\n".join(current), current_page))
        current, current_words = [], 0

    for page_no, page in enumerate(pages, start=1):
        # A passage stays on one page, so "page N" in the prompt is exact.
        flush()
        for block in _blocks(page):
            for piece in _cut_long(block, target_words, max_words):
                words = len(piece.split())
                heading = piece.lstrip().startswith("#")
                if current and (heading or current_words + words > target_words):
                    flush()
                if not current:
                    current_page = page_no if numbered else None
                current.append(piece)
                current_words += words
    flush()
    return [Passage(name, i, chunk, page) for i, (chunk, page) in enumerate(chunks, start=1)]


def _blocks(text: str) -> list[str]:
    """Paragraphs: split at blank lines, and before each Markdown heading."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        lines: list[str] = []
        for line in para.splitlines():
            clean = " ".join(line.split())
            if clean.startswith("#") and lines:
                out.append("\n".join(lines))
                lines = []
            if clean:
                lines.append(clean)
        if lines:
            out.append("\n".join(lines))
    return out


def _cut_long(block: str, target: int, limit: int) -> list[str]:
    if len(block.split()) <= limit:
        return [block]
    sentences = re.split(r"(?<=[.!?])\s+", block)
    pieces: list[str] = []
    current: list[str] = []
    count = 0
    for sentence in sentences:
        words = sentence.split()
        # A "sentence" longer than a passage (a PDF page with no full stops) is cut by words.
        while len(words) > limit:
            if current:
                pieces.append(" ".join(current))
                current, count = [], 0
            pieces.append(" ".join(words[:target]))
            words = words[target:]
        if current and count + len(words) > target:
            pieces.append(" ".join(current))
            current, count = [], 0
        current += words
        count += len(words)
    if current:
        pieces.append(" ".join(current))
    return pieces
