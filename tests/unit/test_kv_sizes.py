"""The planner's cache sizes against mlx-lm's own caches, one tiny model per family.

Each model is built from mlx-lm's model class for its family with a small config
(random weights, nothing written to disk), runs N tokens the way a shard does
(prefill in chunks, then decode steps) through the caches `make_cache()` gives,
and the `nbytes` those caches hold must be within 10 % of what the planner
(`kv_sizes.layer_caches`, through `facts_from_config`) predicts — in total and
layer by layer, so a window or a fixed linear state cannot hide behind the sum.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from studiotui.core.kv_sizes import LayerKV, full_precision_note, layer_caches
from studiotui.core.placement import facts_from_config
from worker.families import make_caches
from worker.shared.kv_quant import family_reason as kv_quant_reason

VOCAB = 128
# Small but with every feature of the family: windows shorter than the context,
# a dense first layer before the MoE ones, linear layers between full ones.
BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
MLA = {
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}
LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
}
QWEN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**QWEN_MOE, "head_dim": 16},
    "deepseek_v3": MLA,
    "deepseek_v32": {**MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 64},
    "glm4_moe": {
        **{k: MLA[k] for k in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok")},
        **{k: MLA[k] for k in ("moe_intermediate_size", "first_k_dense_replace", "n_group")},
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "head_dim": 16,
        "use_qk_norm": True,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "intermediate_size": 64,
        "hidden_size": 64,
    },
    "minimax": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 0,
        "rotary_dim": 8,
        "head_dim": 16,
    },
    "qwen3_next": {
        **LINEAR,
        **QWEN_MOE,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_5": LINEAR,
    "gemma3_text": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
    },
}
PREFILL_CHUNK = 128
TOKENS = 512  # a multiple of mlx-lm's 256-token cache step: allocation = content


def _config(family: str) -> dict[str, Any]:
    config = {**BASE, "model_type": family, **FAMILIES[family]}
    if family == "qwen3_5":  # published as a multimodal config: the decoder in text_config
        return {"model_type": family, "torch_dtype": "float32", "text_config": config}
    return config


def _model(config: dict[str, Any]) -> Any:
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def _run(model: Any, tokens: int, cache: list[Any] | None = None) -> list[Any]:
    """`tokens` tokens through the model's own caches (or `cache`): chunked prefill,
    then decode."""
    cache = make_prompt_cache(model) if cache is None else cache
    ids = mx.random.randint(0, VOCAB, (1, tokens), key=mx.random.key(7))
    prompt = tokens - 2
    for start in range(0, prompt, PREFILL_CHUNK):
        mx.eval(model(ids[:, start : min(prompt, start + PREFILL_CHUNK)], cache=cache))
    for i in range(prompt, tokens):
        mx.eval(model(ids[:, i : i + 1], cache=cache))
    return cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planner_cache_bytes_match_mlx_lm_caches(family: str) -> None:
    config = _config(family)
    model = _model(config)
    caches = _run(model, TOKENS)
    layers = (config.get("text_config") or config)["num_hidden_layers"]
    facts = facts_from_config(config, [1] * layers, 1, 1, family)
    planned = facts.kv_bytes(TOKENS)
    real = [c.nbytes for c in caches]
    print(family, "planned", planned, "real", real)
    assert len(real) == len(planned)
    assert sum(planned) == pytest.approx(sum(real), rel=0.10)
    for layer, (p, r) in enumerate(zip(planned, real, strict=True)):
        assert p == pytest.approx(r, rel=0.10), f"{family} layer {layer}: planned {p}, real {r}"


def test_cache_kinds_follow_the_family() -> None:
    """What each family's caches are made of, as the per-family formulas say."""
    mla = layer_caches(_config("deepseek_v3"))
    assert mla[0] == LayerKV((32 + 8) * 4)  # one latent per token, not per head
    v32 = layer_caches(_config("deepseek_v32"))
    assert v32[0].per_token == (32 + 8 + 2 * 16) * 4
    oss = layer_caches(_config("gpt_oss"))
    assert [kv.window for kv in oss] == [64, None, 64, None]
    gemma = layer_caches(_config("gemma3_text"))
    assert [kv.window for kv in gemma] == [64, None, 64, None]
    nxt = layer_caches(_config("qwen3_next"))
    assert [kv.per_token == 0 and kv.fixed > 0 for kv in nxt] == [True, False, True, False]
    # A linear layer's state is the same at 10 tokens and at a million.
    assert nxt[0].bytes_for(10) == nxt[0].bytes_for(1_000_000)
    assert oss[0].bytes_for(1_000_000) == 64 * oss[0].per_token
    llama = layer_caches(_config("llama"))
    assert llama[0] == LayerKV(2 * 2 * 16 * 4)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3", "gpt_oss", "qwen3_moe"])
def test_quantized_bfloat16_models_cache_in_their_activation_dtype(family: str) -> None:
    """As people download them: bfloat16 activations, 4-bit weights. The caches follow
    the activations (2 bytes a value), the linear recurrent state stays float32."""
    import mlx.nn as nn

    config = {**_config(family), "torch_dtype": "bfloat16"}
    model = _model(config)
    model.set_dtype(mx.bfloat16)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    caches = _run(model, TOKENS)
    facts = facts_from_config(config, [1] * config["num_hidden_layers"], 1, 1, family)
    real = [c.nbytes for c in caches]
    assert facts.kv_bytes(TOKENS) == pytest.approx(real, rel=0.10), real


def _wide(family: str) -> dict[str, Any]:
    """The family's config with heads 32 wide, so K/V quantize in groups of 32 or 64
    would not divide 16."""
    config = _config(family)
    dec = config.get("text_config") or config
    dec["hidden_size"] = 128
    if "head_dim" in dec:
        dec["head_dim"] = 32
    return config


@pytest.mark.parametrize(("bits", "group"), [(8, 32), (4, 32)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planner_quantized_cache_bytes_match_the_shards_caches(
    family: str, bits: int, group: int
) -> None:
    """`--kv-bits`: the shard's own caches (worker.families.make_caches, QuantizedKVCache
    where the family allows it) after N tokens, against the planner's sizes."""
    config = _wide(family)
    model = _model(config)
    layers = (config.get("text_config") or config)["num_hidden_layers"]
    # As load_shard does: a family whose attention cannot read them keeps full caches.
    shard_bits = 0 if kv_quant_reason(config) else bits
    caches = make_caches(model, 0, layers, layers, shard_bits, group)
    _run(model, TOKENS, caches.full)
    facts = facts_from_config(config, [1] * layers, 1, 1, family, kv_bits=bits, kv_group_size=group)
    planned = facts.kv_bytes(TOKENS)
    real = [c.nbytes for c in caches]
    full = facts_from_config(config, [1] * layers, 1, 1, family).kv_bytes(TOKENS)
    print(family, "planned", planned, "real", real, "full", full)
    for layer, (p, r) in enumerate(zip(planned, real, strict=True)):
        assert p == pytest.approx(r, rel=0.10), f"{family} layer {layer}: planned {p}, real {r}"
    if not kv_quant_reason(config):
        # float32 K/V of 32-wide heads: 128 bytes a head; 8-bit keeps 32 + 2 × 4.
        assert sum(planned) < 0.5 * sum(full)
    else:
        assert planned == full


def test_the_preview_note_names_the_layers_kept_full() -> None:
    assert full_precision_note(_wide("llama"), 8) == ""
    assert full_precision_note(_wide("llama"), 0) == ""
    assert "2 of 4 layers with a sliding window" in full_precision_note(_wide("gemma3_text"), 8)
    assert "2 of 4 layers with linear attention" in full_precision_note(_wide("qwen3_next"), 4)
    assert "MLA" in full_precision_note(_config("deepseek_v3"), 8)
    assert "sinks" in full_precision_note(_config("gpt_oss"), 8)
