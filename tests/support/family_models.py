"""Small float32 demo models of every family, written once per module on first use."""

from collections.abc import Callable
from pathlib import Path

from worker.shared.demo_model import DemoSpec, write_demo_model


def small_family_models(root: Path, seed: int) -> Callable[[str], Path]:
    """A getter of a 5-layer float32 demo of a family (by arch), written under `root`
    the first time it is asked for."""

    def get(arch: str) -> Path:
        spec = DemoSpec(
            arch=arch, dtype="float32", seed=seed, layers=5, hidden=64, heads=4, kv_heads=2
        )
        path = root / arch
        return path if path.is_dir() else write_demo_model(path, spec)

    return get
