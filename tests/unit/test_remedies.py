"""What a memory refusal suggests: only what would make the placement fit
(core.placement.remedies, a pure function), and the refusal's kind, which the command
line's exit status follows (cli.exits)."""

from __future__ import annotations

from studiotui.cli import exits
from studiotui.core.placement import (
    REFUSAL_KINDS,
    ModelFacts,
    NodeBudget,
    Refusal,
    plan,
    remedies,
)

GB = 10**9


def facts(
    layer_bytes: int, kv_per_token: int, dtype: str = "bfloat16", q: str | None = None
) -> ModelFacts:
    return ModelFacts("m", "llama", 8, (layer_bytes,) * 8, 0, 0, kv_per_token, dtype, q)


def test_a_tiny_model_whose_kv_does_not_fit_is_not_told_to_use_a_4_bit_copy() -> None:
    # The hostile tester's case: 0.011 GB of weights, 22.9 GB of KV cache.
    model = facts(layer_bytes=11 * 10**6 // 8, kv_per_token=1)
    said = remedies(
        model, weights=11 * 10**6, kv=int(22.9 * GB), available=8 * GB, context_fit=4096
    )
    assert not any("4-bit" in s for s in said)
    assert (
        said[0].startswith("add a node with at least") and "shorten the context to 4096" in said[-1]
    )


def test_a_4_bit_copy_is_suggested_only_where_it_would_fit() -> None:
    model = facts(layer_bytes=GB, kv_per_token=1)  # 8 GB of bfloat16 weights
    fits = remedies(model, weights=8 * GB, kv=GB, available=4 * GB, context_fit=None)
    assert "use a 4-bit copy" in fits  # 2 GB at 4 bits + 1 GB of KV fit in 4
    short = remedies(model, weights=8 * GB, kv=GB, available=2 * GB, context_fit=None)
    assert "use a 4-bit copy" not in short  # 3 GB would still not fit in 2
    four = facts(layer_bytes=GB, kv_per_token=1, q="4-bit")
    assert "use a 4-bit copy" not in remedies(four, 8 * GB, GB, 4 * GB, None)


def test_the_planner_s_refusal_says_only_what_helps() -> None:
    model = facts(layer_bytes=10**6, kv_per_token=10**6)  # weights tiny, KV huge
    verdict = plan(model, [NodeBudget("a", 2 * GB, 4 * GB)], context_tokens=32768)
    assert isinstance(verdict, Refusal) and verdict.kind == "memory"
    assert "4-bit" not in verdict.reason and "shorten the context" in verdict.reason


def test_each_kind_of_refusal_has_its_own_exit_status() -> None:
    model = facts(layer_bytes=10**6, kv_per_token=10)
    group = [NodeBudget(n, 4 * GB, 4 * GB) for n in "ab"]
    for refused in (plan(model, group + group[:1]), plan(model, group, tensor=3)):
        # A node named twice; a tensor size of 3 that does not divide 2 nodes.
        assert isinstance(refused, Refusal) and refused.kind == "shape", refused
    codes = [exits.refused(Refusal("x", kind)) for kind in REFUSAL_KINDS]
    assert len(set(codes)) == len(codes) and exits.ERROR not in codes and 0 not in codes
