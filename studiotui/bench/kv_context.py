"""`kv8_context_ratio`: the context the planner offers with `--kv-bits 8` over the one it
offers at full precision, on the same nodes, for the same model, at the same moment.

The model has the shape the ratio depends on in real checkpoints: bfloat16 activations
and 128-wide attention heads (an 8-bit head keeps 128 bytes and a bfloat16 scale and
bias per 64 values, 136 bytes, against 256); its few layers keep the weights small
beside the KV, as a long context's are. The offers are the planner's own
(`Controller.context_offer`, what `place --dry-run` says) over the memory the running
agents report, and each planned size follows the real caches' `nbytes` within 10 %
(tests/unit/test_kv_sizes.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory
from worker.shared.demo_model import DemoSpec, write_demo_model

SPEC = DemoSpec(
    arch="llama", layers=8, hidden=1024, heads=8, kv_heads=2, intermediate=512, dtype="bfloat16"
)


async def kv_context_figures(home: Path, inv: Inventory) -> dict[str, Any]:
    model = write_demo_model(home / "models" / "bench-kv", SPEC)
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        nodes = [n.name for n in ctl.state.nodes if n.state == "up"]
        full = ctl.context_offer(model, nodes)
        kv8 = ctl.context_offer(model, nodes, kv_bits=8)
        kv4 = ctl.context_offer(model, nodes, kv_bits=4)
    finally:
        await ctl.close()
    return {
        "kv_full_context_tokens": full,
        "kv8_context_tokens": kv8,
        "kv8_context_ratio": round(kv8 / full, 3) if full else None,
        "kv4_context_ratio": round(kv4 / full, 3) if full else None,
    }
