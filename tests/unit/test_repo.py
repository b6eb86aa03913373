"""The repository stands alone: CI runs the README's own test command from a clean clone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_from_a_lone_clone() -> None:
    install, tests = _readme_commands()[:2]
    assert "pytest" in tests and "studiotui" in install
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert tests in ci.splitlines(), "CI must run the README's test command as written"
    # README: the suite needs sshd, which .ci/install-sshd.sh installs; CI runs it first.
    lines = ci.splitlines()
    assert "bash .ci/install-sshd.sh" in lines and (ROOT / ".ci" / "install-sshd.sh").is_file()
    assert lines.index("bash .ci/install-sshd.sh") < lines.index(tests)
    assert "git clone" in ci and "mktemp -d" in ci


def test_fixtures_live_in_the_repository() -> None:
    macos = ROOT / "tests" / "fixtures" / "macos"
    assert (macos / "README.md").is_file()
    recorded = [p for p in macos.iterdir() if p.suffix in {".txt", ".json", ".jsonl", ".jsonc"}]
    assert len(recorded) >= 30
    # No test reaches outside the repository for its inputs.
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and '"shared" / "fixtures"' not in text, path.name


def test_imports_run_one_way() -> None:
    """The import-linter contracts in pyproject.toml: layers, no loops, the wire shared."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a test dependency: pip install -e '.[test]'"
    run = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_the_docs_name_only_files_that_exist_and_the_layout_names_every_module() -> None:
    """docs/architecture.md is the truth about what exists: every path the docs name is
    there, and its Layout tree names every module of both sides; every test
    docs/claims.md cites is defined where it says."""
    docs = {p: (ROOT / p).read_text(encoding="utf-8") for p in ARCH_DOCS}
    for doc, text in docs.items():
        for path in set(re.findall(r"\b(?:studiotui|worker|tests)/[\w/]+\.(?:py|tcss)\b", text)):
            assert (ROOT / path).is_file(), f"{doc} names {path}, which does not exist"
    arch = docs["docs/architecture.md"]
    layout = arch.split("## Layout", 1)[1].split("\n## ", 1)[0]
    modules = [
        p
        for side in ("studiotui", "worker")
        for p in (ROOT / side).rglob("*.py")
        if p.name != "__init__.py"
    ]
    # By name: the tree says `run.py, ring.py` or, for the panes, `nodes, topology`.
    unnamed = [str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{p.stem}\b", layout)]
    assert not unnamed, f"docs/architecture.md's Layout does not name {unnamed}"
    # claims.md cites `dir/file.py::test`, and `::test` for another of the same file.
    cited = 0
    for row in docs["docs/claims.md"].splitlines():
        file = None
        for named, test in re.findall(r"(?:((?:app|unit|integration)/\w+\.py))?::(test_\w+)", row):
            file = named or file
            assert file, row
            source = (ROOT / "tests" / file).read_text(encoding="utf-8")
            assert re.search(rf"def {test}\(", source), f"claims.md cites {file}::{test}"
            cited += 1
    assert cited > 100, cited


def _docs_pages() -> tuple[str, ...]:
    """The README and every page of the docs site (docs/**/*.md), as repository paths."""
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    return ("README.md", *pages)


ARCH_DOCS = _docs_pages()


def _generator():  # type: ignore[no-untyped-def]
    """docs/hooks/generate.py, the mkdocs hook that writes the CLI reference and the
    bench table when the site is built."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs/hooks/generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_keys() -> set[str]:
    code = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "studiotui/bench").glob("*.py"))
    return set(re.findall(r"""["']([a-z][a-z0-9_]*)["']""", code))


def test_every_bench_field_the_docs_name_is_one_the_bench_reports() -> None:
    """The performance page's figures are one saved run, but the fields it names are
    claims: each is a key `studiotui bench --json` prints (a string in studiotui/bench),
    and so is every row of the table the site writes from a saved run."""
    page = (ROOT / "docs/performance.md").read_text(encoding="utf-8").replace("\n", " ")
    fields = {
        name
        for name in re.findall(r"`([^`]+)`", page)
        if re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9*]+)+|streams", name)
    }
    fields |= set(_generator().FIELDS)
    assert len(fields) > 30, fields
    keys = _bench_keys()
    for name in sorted(fields):
        pattern = re.compile(name.replace("*", r"\w+"))
        assert any(pattern.fullmatch(key) for key in keys), f"the bench reports no {name}"


def test_the_bench_table_is_the_saved_run() -> None:
    """docs/data/bench.json is a `studiotui bench --json` run: the table shows each of its
    figures that FIELDS describes, with the value the run gave."""
    import json

    figures = json.loads((ROOT / "docs/data/bench.json").read_text(encoding="utf-8"))
    gen = _generator()
    table = gen.bench_table(figures)
    assert figures["tokens_match"] is True
    shown = [key for key in gen.FIELDS if key in figures]
    assert len(shown) > 20, shown
    for key in shown:
        assert f"| `{key}` | {gen._value(figures[key])} |" in table, key
    page = (ROOT / "docs/performance.md").read_text(encoding="utf-8")
    assert gen.render(page).count("| `single_tps` |") == 1


def test_the_cli_reference_is_written_from_every_parser() -> None:
    """docs/cli.md is filled in from build_parser() when the site is built: every verb
    and sub-verb has its section, with each of its options."""
    import argparse

    from studiotui.cli.main import build_parser

    page = (ROOT / "docs/cli.md").read_text(encoding="utf-8")
    gen = _generator()
    reference = gen.render(page)

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> int:
        assert f"## `{' '.join(words)}`" in reference, words
        section = reference.split(f"## `{' '.join(words)}`", 1)[1].split("\n## ", 1)[0]
        # A verb's copies of the global options are said once, at the top.
        said_once = gen._global(parser) if len(words) > 1 else set()
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and action not in said_once:
                    assert f"`{flag}`" in section, (words, flag)
        count = 1
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    count += walk(child, [*words, name])
        return count

    assert walk(build_parser(), ["studiotui"]) > 20


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc make it."""
    text = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"\s+", "-", text)


def test_every_link_of_the_readme_resolves() -> None:
    """The README's links to files and sections are there (mkdocs build --strict checks
    the docs pages' own links)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) > 10, links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path} has no section #{anchor}"


def test_the_readme_is_a_front_door_and_the_docs_keep_no_diary() -> None:
    """The README stays short, architecture.md a reference; no page tells the history of
    the runs that made it (git and CHANGELOG.md keep that): "session" is a chat's."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert len((ROOT / "docs/architecture.md").read_text(encoding="utf-8").splitlines()) <= 800
    # The words of the code that name a session (the chat's, a module, a POSIX one).
    allowed = re.compile(
        r"ChatSession|chat session|session\.py|start_new_session|Controller\.session|POSIX session"
    )
    for page in _docs_pages():
        for number, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines()):
            said = allowed.sub("", line)
            assert not re.search(r"session|this VM", said, re.I), f"{page}:{number + 1}: {line}"


def test_the_bench_apart_contract_names_every_room_of_the_product() -> None:
    """`bench-apart` forbids the bench to each room by name (a forbidden contract cannot
    say "all of studiotui but the bench"), so a new room must join its list."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}
    sources = set(contracts["bench-apart"]["source_modules"])
    rooms = {
        f"studiotui.{p.name}"
        for p in (ROOT / "studiotui").iterdir()
        if (p / "__init__.py").is_file() and p.name != "bench"
    }
    modules = {
        f"studiotui.{p.stem}" for p in (ROOT / "studiotui").glob("*.py") if p.stem != "__init__"
    }
    assert rooms | modules | {"worker"} == sources
    assert rooms | modules == set(contracts["operator-uses-shared-only"]["source_modules"])
