from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from studiotui.bench.provision import python_with_deps
from studiotui.provision.deploy import CheckoutWheel
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.sshd import agents, ssh_nodes, sshd_factory, sshd_server  # noqa: F401 - fixtures
from worker.shared.demo_model import DemoSpec, write_demo_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start agents or sshd are `integration`: `pytest -m "not integration"`
    runs the fast part (pure functions, the app on fixed states) in under a minute."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        live = any("cluster" in name or "sshd" in name for name in fixtures)
        if live or "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session")
def engine_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four real agents on 127.0.0.61-64:55500."""
    yield from cluster_fixture(tmp_path_factory.mktemp("engine-home"), 4, 61, 55500)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small float32 model per family, 7 layers so splits are uneven."""
    root = tmp_path_factory.mktemp("models")
    return {
        arch: write_demo_model(
            root / arch,
            DemoSpec(arch=arch, layers=7, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=7),
        )
        for arch in FAMILIES
    }


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> CheckoutWheel:
    """The worker wheel, built once for the whole session (the slow part)."""
    source = CheckoutWheel(tmp_path_factory.mktemp("wheels"))
    asyncio.run(source.path())
    return source


@pytest.fixture(scope="session")
def node_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv's python with the worker's dependencies: used as is, nothing to pip install."""
    return python_with_deps(tmp_path_factory.mktemp("venv") / "v")
