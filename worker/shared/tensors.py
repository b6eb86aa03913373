"""MLX's tree helpers with the types they really return.

`mlx.utils.tree_flatten` of a module's parameters gives `(name, array)` pairs; its stub
also admits other shapes, so every caller would need a cast. One here instead.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten


def named_arrays(tree: Any) -> list[tuple[str, mx.array]]:
    """The leaves of a parameter tree (a module's `parameters()`), by dotted name."""
    return cast(list[tuple[str, mx.array]], tree_flatten(tree))
