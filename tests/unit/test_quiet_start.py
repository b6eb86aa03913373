"""A command prints what it has to say and nothing from the libraries under it."""

import subprocess
import sys


def test_a_command_prints_no_library_warning() -> None:
    # cryptography ≥ 48 warns about DSA at asyncssh's import; a `serve` whose first
    # lines are those warnings hides its address from whoever reads it.
    done = subprocess.run(
        [sys.executable, "-W", "default", "-m", "studiotui", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "usage" in done.stdout.lower()
    assert "Warning" not in done.stderr, done.stderr
