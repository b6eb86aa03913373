"""The pure placement planner: which node runs which contiguous range of a model's layers.

No I/O here. The controller gathers the facts (model sizes, free memory, measured
links) and this package turns them into a `Plan` or a `Refusal` a human can read, so
the preview the operator sees is exactly what will be deployed and every rule can be
tested without a cluster.

Sizes are shown in binary units labelled "GB"/"MB", as macOS reports unified memory
(a "512 GB" Mac Studio has 512 GiB).

The modules, by what they do (importers use the names re-exported here):

- `facts`: what the planner is given (`ModelFacts`, `TensorFacts`, `NodeBudget`, `Link`);
- `plans`: what it answers (`Plan`, `ShardPlan`, `Refusal`) and the JSON view;
- `planner`: `plan` and `longest_context`;
- `ring`: links ranked and the ring's order; `split`: layers cut into ranges;
- `accounting`: the reserve, what a shard holds besides layers, the prompt cache;
- `refusals`: why a model does not fit, and what would; `tensor`: tensor groups;
- `config`: `ModelFacts` from config.json; `words`: sizes and lists for people;
- `disk`: the prompt cache's disk budget against each node's free disk.
"""

from studiotui.core.placement.accounting import (
    CACHE_DISK_MULTIPLE,
    CACHE_KV_MULTIPLE,
    CACHE_SHARE_OF_FREE,
    reserve_bytes,
    with_prompt_cache,
)
from studiotui.core.placement.config import (
    context_beyond,
    facts_from_config,
    kv_bytes_per_token,
    trained_positions,
)
from studiotui.core.placement.disk import disk_by_node, fit_disk
from studiotui.core.placement.facts import Link, ModelFacts, NodeBudget, TensorFacts, with_adapter
from studiotui.core.placement.planner import longest_context, plan
from studiotui.core.placement.plans import REFUSAL_KINDS, Plan, Refusal, ShardPlan, plan_to_dict
from studiotui.core.placement.refusals import remedies
from studiotui.core.placement.ring import link_figures
from studiotui.core.placement.tensor import backend_for, tensor_refusal, tensor_sizes
from studiotui.core.placement.words import format_bytes, gb

__all__ = [
    "CACHE_DISK_MULTIPLE",
    "CACHE_KV_MULTIPLE",
    "CACHE_SHARE_OF_FREE",
    "REFUSAL_KINDS",
    "Link",
    "ModelFacts",
    "NodeBudget",
    "Plan",
    "Refusal",
    "ShardPlan",
    "TensorFacts",
    "backend_for",
    "context_beyond",
    "disk_by_node",
    "facts_from_config",
    "fit_disk",
    "format_bytes",
    "gb",
    "kv_bytes_per_token",
    "link_figures",
    "longest_context",
    "plan",
    "plan_to_dict",
    "remedies",
    "reserve_bytes",
    "tensor_refusal",
    "tensor_sizes",
    "trained_positions",
    "with_adapter",
    "with_prompt_cache",
]
