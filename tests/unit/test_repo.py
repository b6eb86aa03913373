"""The repository stands alone: CI runs the README's own test command from a clean clone."""

from __future__ import annotations

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
