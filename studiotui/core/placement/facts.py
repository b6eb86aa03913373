"""What the planner is given: a model's sizes (`ModelFacts`, `TensorFacts`), each
node's memory (`NodeBudget`) and the measured links between nodes (`Link`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from studiotui.core.kv_sizes import (
    LayerKV,
)
from studiotui.core.placement.words import _joined


@dataclass(frozen=True)
class TensorFacts:
    """What mlx-lm's `shard()` splits when a stage runs as a tensor group of N nodes.

    `dims` are the sizes N must divide (attention heads, KV heads, MLP and expert widths
    in quantization groups: `mx.split` refuses an uneven cut, and a head cannot be
    halved); `layer_split` is each layer's bytes that `shard()` cuts N ways (attention
    and MLP projections, every expert); the rest of a layer (norms, the router,
    DeepSeek's `q_a_proj`/`kv_a_proj`) and the embedding and head stay whole on every
    node. `kv_split`: the cache is per head and so split too; an MLA latent is not."""

    dims: tuple[tuple[str, int], ...]
    layer_split: tuple[int, ...]
    kv_split: bool = True

    def refusal(self, n: int) -> str | None:
        """Why `shard()` cannot cut this model `n` ways, or None."""
        bad = [f"{label} {size}" for label, size in self.dims if size % n]
        if not bad:
            return None
        return f"a tensor group of {n} must divide its {_joined(bad, 'and')}"


@dataclass(frozen=True)
class ModelFacts:
    name: str
    family: str
    n_layers: int
    layer_bytes: tuple[int, ...]  # weight bytes of each layer
    embed_bytes: int  # held by the first shard
    head_bytes: int  # final norm + lm_head (tied embeddings: the caller counts them here too)
    kv_bytes_per_token: int  # per layer, K+V, for one token (when layer_kv is empty)
    dtype: str = "float32"
    quantization: str | None = None
    # Each layer's cache as the family keeps it (MLA latent, sliding window, linear
    # state); empty: every layer keeps kv_bytes_per_token for every token.
    layer_kv: tuple[LayerKV, ...] = ()
    # None: the family has no `shard()` in mlx-lm, so only pipelines of one-node stages.
    tensor: TensorFacts | None = None
    # For the speed forecast (studiotui/core/forecast.py): the routed experts' bytes of
    # each layer (a token reads `experts_active` of them), the residual width an
    # all-reduce carries, the attention width a prefill multiplies by the context, and
    # the bits each weight takes (scales included) to turn bytes into FLOPs.
    layer_experts: tuple[int, ...] = ()
    experts_active: float = 1.0
    hidden_size: int = 0
    attn_width: int = 0
    bits_per_weight: float = 0.0
    # An adapter placed with the model (see `with_adapter`): its bytes on each layer,
    # held beside that layer's weights by the shard running it; () without one.
    layer_adapter: tuple[int, ...] = ()
    # The positions the model was trained for (config.json's max_position_embeddings,
    # stretched by a RoPE scaling factor); 0: not said.
    max_positions: int = 0

    def __post_init__(self) -> None:
        # Bad facts are a bug in the caller, not something to explain to the operator.
        if self.n_layers < 1:
            raise ValueError(f"{self.name}: a model needs at least one layer")
        if len(self.layer_bytes) != self.n_layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_bytes)} layer sizes for {self.n_layers} layers"
            )
        if self.layer_kv and len(self.layer_kv) != self.n_layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_kv)} layer caches for {self.n_layers} layers"
            )
        for name, per_layer in (
            ("split", self.tensor.layer_split if self.tensor else ()),
            ("expert", self.layer_experts),
            ("adapter", self.layer_adapter),
        ):
            if per_layer and len(per_layer) != self.n_layers:
                raise ValueError(f"{self.name}: {len(per_layer)} {name} sizes for {self.n_layers}")
        sizes = (
            *self.layer_bytes,
            *self.layer_adapter,
            self.embed_bytes,
            self.head_bytes,
            self.kv_bytes_per_token,
        )
        if min(sizes) < 0:
            raise ValueError(f"{self.name}: sizes cannot be negative")

    def kv_bytes(self, tokens: int, streams: int = 1) -> list[int]:
        """Each layer's cache bytes once `streams` requests hold `tokens` tokens each."""
        if not self.layer_kv:
            return [self.kv_bytes_per_token * tokens * streams] * self.n_layers
        return [kv.bytes_for(tokens) * streams for kv in self.layer_kv]

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes

    @property
    def adapter_bytes(self) -> int:
        return sum(self.layer_adapter)


def with_adapter(model: ModelFacts, adapter_layer_bytes: Sequence[int]) -> ModelFacts:
    """The model as placed with an adapter: `adapter_layer_bytes[i]` more on layer i (its
    LoRA/DoRA tensors, counted from the adapter's safetensors header by the caller)."""
    return replace(model, layer_adapter=tuple(int(b) for b in adapter_layer_bytes))


@dataclass(frozen=True)
class NodeBudget:
    name: str
    free_bytes: int
    total_bytes: int

    def __post_init__(self) -> None:
        if self.free_bytes < 0 or self.total_bytes < 0:
            raise ValueError(f"{self.name}: memory cannot be negative")


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    latency_us: float | None
    gbps: float | None
    kind: str  # "thunderbolt", "ethernet", "wifi", "loopback", "unknown"
    # Both ends report RDMA over Thunderbolt usable (the agents' `facts["rdma"]`):
    # MLX's JACCL backend can run a tensor group over it.
    rdma: bool = False
    # Why not, when both nodes have RDMA but no active cable joins them
    # ("studio-2 has no cable to studio-4"; core/members.rdma_pair); "" otherwise.
    rdma_why: str = ""
