"""The worker wheel provisioning carries to the nodes: built from this checkout at
most once per source state (cached under STUDIOTUI_HOME/wheels by version and a hash
of its files, read once so the build and its hash agree even while the checkout is
edited), or a prebuilt wheel file named by the operator."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import shutil
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from studiotui.core.errors import StudioError
from studiotui.core.text import last_lines
from studiotui.provision.plan import extra_requirements, node_requirements


class BuildError(StudioError, RuntimeError):
    """The worker wheel could not be built from this checkout."""


class WheelSource(Protocol):
    """Where the worker wheel comes from, and what it is."""

    @property
    def build(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def requirements(self) -> tuple[str, ...]: ...

    async def path(self) -> Path: ...


def project_root() -> Path:
    """The checkout this studiotui runs from (the directory with its pyproject.toml)."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    try:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        name = None
    if name != "studiotui":
        raise BuildError(
            f"studiotui runs from {root}, which is not a checkout of it (no pyproject.toml "
            "naming studiotui); provisioning builds the worker wheel from a checkout"
        )
    return root


_TOP_FILES = re.compile(
    r"(pyproject\.toml|setup\.cfg|setup\.py|MANIFEST\.in|README.*|LICEN[CS]E.*)"
)


def _source_files(root: Path) -> dict[str, bytes]:
    """The files a wheel is built from, read once: the build and its hash agree
    even while someone edits the checkout."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    find = project.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    patterns = find.get("include") or ["studiotui*", "worker*", "themes*"]
    roots = sorted({p.rstrip("*").rstrip(".") for p in patterns if p.rstrip("*")})
    files: dict[str, bytes] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and _TOP_FILES.fullmatch(entry.name):
            files[entry.name] = entry.read_bytes()
    for name in roots:
        base = root / name
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(root)
            if not path.is_file() or any(
                part == "__pycache__" or part.startswith(".") or part.endswith(".egg-info")
                for part in rel.parts
            ):
                continue
            if path.suffix in (".pyc", ".pyo"):
                continue
            files[rel.as_posix()] = path.read_bytes()
    return files


def files_digest(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


class CheckoutWheel:
    """A wheel of this checkout, built with `pip wheel` at most once per source state."""

    def __init__(self, cache: Path, root: Path | None = None) -> None:
        self.root = root or project_root()
        self.cache = cache
        self._files = _source_files(self.root)
        project = tomllib.loads(self._files["pyproject.toml"].decode())["project"]
        self._version = str(project["version"])
        self._requirements = node_requirements(project)
        self._build = f"{self._version}+{files_digest(self._files)[:12]}"
        self._lock = asyncio.Lock()
        self.built_now = False

    @property
    def build(self) -> str:
        return self._build

    @property
    def version(self) -> str:
        return self._version

    @property
    def requirements(self) -> tuple[str, ...]:
        return self._requirements

    def cached(self) -> Path | None:
        found = sorted((self.cache / self._build).glob("*.whl"))
        return found[0] if found else None

    async def path(self) -> Path:
        async with self._lock:
            cached = self.cached()
            if cached is not None:
                return cached
            built = await self._build_wheel()
            self.built_now = True
            return built

    async def _build_wheel(self) -> Path:
        self.cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=self.cache))
        try:
            src = work / "src"
            for rel, data in self._files.items():
                target = src / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            out = work / "out"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--disable-pip-version-check",
                "--no-input",
                "-q",
                "-w",
                str(out),
                str(src),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            output, _ = await proc.communicate()
            wheels = sorted(out.glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                raise BuildError(
                    "building the worker wheel failed (`pip wheel` exited with "
                    f"{proc.returncode}):\n{last_lines(output.decode(errors='replace'))}"
                )
            final = self.cache / self._build
            staged = work / self._build
            staged.mkdir()
            shutil.move(str(wheels[0]), staged / wheels[0].name)
            with contextlib.suppress(OSError):
                # Another process may have built the same source meanwhile.
                staged.rename(final)
            return sorted(final.glob("*.whl"))[0]
        finally:
            shutil.rmtree(work, ignore_errors=True)


class PrebuiltWheel:
    """An existing wheel file; its build id is its version plus a hash of the file."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        with zipfile.ZipFile(wheel) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = z.read(meta_name).decode()
        version = re.search(r"^Version: (.+)$", meta, re.M)
        if version is None:
            raise BuildError(f"{wheel} has no Version in its METADATA")
        self._version = version.group(1).strip()
        reqs = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
        self._requirements = extra_requirements(reqs)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        self._build = f"{self._version}+w{digest[:11]}"

    @property
    def build(self) -> str:
        return self._build

    @property
    def version(self) -> str:
        return self._version

    @property
    def requirements(self) -> tuple[str, ...]:
        return self._requirements

    async def path(self) -> Path:
        return self.wheel
