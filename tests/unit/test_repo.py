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


ARCH_DOCS = ("README.md", "docs/architecture.md", "docs/reliability.md", "docs/claims.md")


def test_every_bench_field_the_readme_names_is_one_the_bench_reports() -> None:
    """README's Performance figures are measurements, but the fields it names are
    claims: each is a key `studiotui bench --json` prints (a string in studiotui/bench)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Performance", 1)[1].replace("\n", " ")
    not_fields = {"all_sum", "async_eval", "sgemm_", "qwen3_moe", "tp_rank"}
    fields = {
        name
        for name in re.findall(r"`([^`]+)`", section)
        if re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9*]+)+|streams", name) and name not in not_fields
    }
    assert len(fields) > 30, fields
    code = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "studiotui/bench").glob("*.py"))
    keys = set(re.findall(r"""["']([a-z][a-z0-9_]*)["']""", code))
    for name in sorted(fields):
        pattern = re.compile(name.replace("*", r"\w+"))
        assert any(pattern.fullmatch(key) for key in keys), f"the bench reports no {name}"
