"""Deterministic demo models that `mlx_lm.load` loads unchanged.

No model can be downloaded here, so the project writes its own: the real mlx-lm
model class of the chosen family decides the tensor names and shapes (experts,
latent attention, linear-attention state and all), numpy's PCG64 generator
(stable across versions and platforms) fills each tensor from the seed and the
tensor's name, and the tokenizer is a real byte-level BPE `tokenizer.json` with a
ChatML template. The weights are random: the text a demo model writes is noise,
but every code path (loading, sharding, KV caches, sampling, detokenising) is the
one a real model takes. `quantize` packs the weights with mlx-lm's own
`quantize_model` (which modules, which bits, the config it records) and each
module's own `to_quantized`, as `mlx_lm.convert` does.

The files are written one module at a time straight into safetensors files whose
header is planned first (shapes and dtypes of lazy, never evaluated arrays), so
the memory a write needs is that of the largest module, not of the model. The
directory appears only when complete: everything goes to a hidden `.NAME.partial`
sibling first, removed on any failure or interrupt.

With `recite`, the model writes a fixed passage instead of noise, so a newcomer's
first chat reads as an answer. Nothing is trained: the tokenizer gets one BPE
token per word of the passage, the embedding of each is scaled up so the random
layers barely move it, and the output head maps each token's direction to the
next token of the passage (the chat template's last "\n" to its first word, its
last word to end-of-turn). Every layer still runs on every token.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.shared.tensors import named_arrays

DENSE = ("llama", "qwen2", "qwen3", "mistral")
# Mixture-of-experts and hybrid families; each demo keeps a few experts and a small width.
MOE = (
    "qwen3_moe",
    "deepseek_v3",
    "kimi_k25",
    "deepseek_v32",
    "glm4_moe",
    "gpt_oss",
    "minimax",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "mixtral",
    "gemma3_text",
    "glm4_moe_lite",
    "qwen2_moe",
)
FAMILIES = DENSE + MOE
# Families whose mlx-lm model looks up one layer of a repeating pattern by its index
# (the demo's patterns below): with fewer layers that layer is missing, and the model
# loads but fails its first forward with an IndexError.
_EVERY_THIRD = "mlx-lm's model finds its first full-attention layer, every third one"
LEAST_LAYERS_WHY = {
    "qwen3_next": _EVERY_THIRD,
    "qwen3_5": _EVERY_THIRD,
    "qwen3_5_moe": _EVERY_THIRD,
    "gemma3_text": "mlx-lm's model finds its first global-attention layer, every third one",
    "gpt_oss": "its layers alternate sliding and full attention, and mlx-lm needs a full one",
}
LEAST_LAYERS = {"gpt_oss": 2} | {arch: 3 for arch in LEAST_LAYERS_WHY if arch != "gpt_oss"}
# Those whose experts are SwitchLinear (mlx-lm's gather_mm): all of MOE but two dense hybrids.
HAS_EXPERTS = tuple(f for f in MOE if f not in ("qwen3_5", "gemma3_text"))
# --quantize: affine 4 or 8 bits, MLX's float formats, or mlx-lm's "mixed_4_6" recipe.
QUANTIZE = ("4", "8", "mxfp4", "mxfp8", "nvfp4", "mixed")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PASSAGE = (
    "Hello from studiotui! This demo model grew out of a fixed seed, so its weights "
    "hold one short passage rather than knowledge: your prompt crossed every shard in "
    "the pipeline; each node ran only those layers it owns before passing activations "
    "over ZeroMQ while whichever held last sampled these tokens \u2014 place any real "
    "mlx-lm checkpoint to chat properly."
)
# ChatML, with tool calls laid out as Qwen's templates do (mlx-lm reads tool calls
# from such a model with its json_tools parser). A chat without tools renders
# exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\n<tool_call>\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


class DemoModelError(ValueError):
    """The demo model cannot be written (bad spec, no room); the message says why."""


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "llama"
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int | None = None
    seed: int = 0
    dtype: str = "bfloat16"
    tie_embeddings: bool = False
    files: int = 1  # safetensors files; above 1, split by layer with an index, as big models are
    recite: bool = False  # write PASSAGE instead of noise (the first-run demo does)
    experts: int = 4  # routed experts of a mixture-of-experts family (2 active per token)
    quantize: str | None = None  # one of QUANTIZE
    group_size: int | None = None  # affine quantization group (default 64)

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise DemoModelError(f"unknown arch {self.arch!r}; choose one of {', '.join(FAMILIES)}")
        for option, value, least in (
            ("--layers", self.layers, 1),
            ("--hidden", self.hidden, 8),
            ("--heads", self.heads, 1),
            ("--kv-heads", self.kv_heads, 1),
            ("--files", self.files, 1),
        ):
            if value < least:
                raise DemoModelError(f"{option} must be at least {least}, got {value}")
        if self.hidden % self.heads:
            fit = -(-self.hidden // self.heads) * self.heads
            raise DemoModelError(
                f"--hidden {self.hidden} is not a multiple of --heads {self.heads}: "
                f"each head gets an equal share (--hidden {fit} would do)"
            )
        if self.heads % self.kv_heads:
            raise DemoModelError(
                f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}: "
                "key/value heads are shared by equal groups of heads"
            )
        least = LEAST_LAYERS.get(self.arch, 1)
        if self.layers < least:
            raise DemoModelError(
                f"--arch {self.arch} needs at least {least} --layers, got {self.layers}: "
                f"{LEAST_LAYERS_WHY[self.arch]}"
            )
        if self.seed < 0 or (self.intermediate is not None and self.intermediate < 1):
            raise DemoModelError("--seed must be 0 or more and --intermediate at least 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise DemoModelError(f"unknown dtype {self.dtype!r}")
        if self.recite and self.tie_embeddings:
            raise DemoModelError("a reciting demo needs its own output head (no tied embeddings)")
        if self.experts < 2:
            raise DemoModelError("a mixture-of-experts demo needs at least 2 experts")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise DemoModelError(
                f"unknown quantization {self.quantize!r}; choose one of {', '.join(QUANTIZE)}"
            )
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise DemoModelError("the quantization group size must be 32, 64 or 128")
        if self.group_size is not None and self.quantize not in ("4", "8", "mixed"):
            raise DemoModelError(
                "--group-size applies to affine quantization (--quantize 4, 8 or mixed); "
                "mxfp4, mxfp8 and nvfp4 have fixed groups"
            )
        if self.quantize and self.hidden % self.quant_params()["group_size"]:
            raise DemoModelError(
                f"hidden size {self.hidden} is not a multiple of the quantization group "
                f"{self.quant_params()['group_size']}: nothing would be quantized"
            )

    def quant_params(self) -> dict[str, Any]:
        """group_size, bits and mode for mlx-lm's quantize_model."""
        q = self.quantize
        if q in _FLOAT_FORMATS:
            group, bits = _FLOAT_FORMATS[q]
            return {"group_size": group, "bits": bits, "mode": q}
        return {"group_size": self.group_size or 64, "bits": 8 if q == "8" else 4, "mode": "affine"}


# MLX's float formats have one group size and width each.
_FLOAT_FORMATS = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}


def vocab_size(recite: bool = False) -> int:
    return 256 + len(SPECIAL_TOKENS) + (len(_passage_merges()) if recite else 0)


def make_config(spec: DemoSpec) -> dict:
    intermediate = spec.intermediate or _round_up(int(spec.hidden * 8 / 3), 32)
    config: dict = {
        "architectures": [_ARCH_CLASS[spec.arch]],
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size(spec.recite),
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": spec.dtype,
        "bos_token_id": None,
        "eos_token_id": 256 + SPECIAL_TOKENS.index("<|im_end|>"),
        "studiotui_demo": {"seed": spec.seed, **({"recite": True} if spec.recite else {})},
    }
    config.update(_family_fields(spec))
    if spec.arch == "kimi_k25":
        # Kimi K2.5 nests its DeepSeek-V3 decoder under text_config, as it ships.
        text = {**config, "model_type": "kimi_k2"}
        for key in ("architectures", "studiotui_demo", "torch_dtype"):
            text.pop(key)
        config = {
            key: config[key]
            for key in (
                "architectures",
                "model_type",
                "vocab_size",
                "eos_token_id",
                "bos_token_id",
                "tie_word_embeddings",
                "torch_dtype",
                "studiotui_demo",
            )
        }
        config["text_config"] = text
    return config


def _family_fields(spec: DemoSpec) -> dict[str, Any]:
    """What a family's config.json has beyond the dense decoder's fields, at demo size."""
    head_dim = spec.hidden // spec.heads
    experts = {"num_experts_per_tok": 2}
    expert_width = spec.hidden  # a multiple of the quantization group, so experts quantize
    mla = {
        "n_routed_experts": spec.experts,
        "n_shared_experts": 1,
        "moe_intermediate_size": expert_width,
        "kv_lora_rank": spec.hidden,
        "q_lora_rank": spec.hidden,
        "qk_rope_head_dim": head_dim // 2,
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
        "first_k_dense_replace": 1,  # DeepSeek's first layers are dense, the rest MoE
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "num_key_value_heads": spec.heads,
        "rope_scaling": None,
        **experts,
    }
    linear = {
        "linear_num_value_heads": spec.heads,
        "linear_num_key_heads": spec.kv_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 3,  # every third layer attends over the whole context
    }
    qwen_moe = {
        "num_experts": spec.experts,
        "moe_intermediate_size": expert_width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        **experts,
    }
    window = 8  # short, so a test's prompt already slides past it
    fields: dict[str, dict[str, Any]] = {
        "qwen3_moe": qwen_moe,
        "mixtral": {"num_local_experts": spec.experts, "rope_traditional": False, **experts},
        "deepseek_v3": mla,
        "kimi_k25": mla,
        "deepseek_v32": {
            **mla,
            "index_head_dim": 2 * head_dim,
            "index_n_heads": 2,
            "index_topk": 8,  # a prompt longer than this takes the sparse path
        },
        "glm4_moe": {
            **mla,
            **{k: None for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")},
            "num_key_value_heads": spec.kv_heads,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": True,
            "attention_bias": True,
        },
        "gpt_oss": {
            "num_local_experts": spec.experts,
            "intermediate_size": expert_width,
            "sliding_window": window,
            "layer_types": [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)
            ],
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            **experts,
        },
        "minimax": {
            "num_local_experts": spec.experts,
            "intermediate_size": expert_width,
            "shared_intermediate_size": 0,
            "rotary_dim": head_dim // 2,
            "use_qk_norm": True,
            "scoring_func": "sigmoid",
            **experts,
        },
        "qwen3_next": {
            **linear,
            **qwen_moe,
            "shared_expert_intermediate_size": expert_width,
            "partial_rotary_factor": 0.25,
        },
        "qwen3_5": {
            **linear,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        "qwen3_5_moe": {
            **linear,
            **qwen_moe,
            "shared_expert_intermediate_size": expert_width,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        "glm4_moe_lite": {**mla, "num_nextn_predict_layers": 0},
        "qwen2_moe": {
            "num_experts": spec.experts,
            "moe_intermediate_size": expert_width,
            "shared_expert_intermediate_size": expert_width,
            **experts,
        },
        "gemma3_text": {
            "query_pre_attn_scalar": head_dim,
            "sliding_window": window,
            "sliding_window_pattern": 3,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
        },
    }
    out = dict(fields.get(spec.arch, {}))
    if spec.arch in ("deepseek_v3", "kimi_k25", "deepseek_v32", "glm4_moe", "glm4_moe_lite"):
        out["intermediate_size"] = 2 * spec.hidden  # the dense first layer
    return out


_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "minimax": "MiniMaxM2ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def build_model(config: dict) -> nn.Module:
    """The family's mlx-lm model class, built lazily: no weight memory is touched."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes exactly as the family's mlx-lm class declares them."""
    return {name: tuple(p.shape) for name, p in named_arrays(build_model(config).parameters())}


# ---- planning: which arrays, of which shapes and dtypes, without computing any --------


@dataclass
class _Part:
    """A module with arrays of its own, and how it is written."""

    path: str
    module: nn.Module
    quant: dict[str, Any] | None
    lazy: dict[str, mx.array]  # its arrays as built: placeholders, never evaluated


def _plan(spec: DemoSpec, config: dict) -> tuple[list[_Part], dict]:
    """The model's modules in writing order, and the config to write (quantization
    recorded as mlx-lm's quantize_model records it)."""
    model = _cast(build_model(config), spec.dtype)
    quant_of: dict[str, dict[str, Any]] = {}
    if spec.quantize:
        from mlx_lm.convert import mixed_quant_predicate_builder
        from mlx_lm.utils import quantize_model

        q = spec.quant_params()
        shadow = _cast(build_model(config), spec.dtype)
        predicate = (
            mixed_quant_predicate_builder("mixed_4_6", shadow, q["group_size"])
            if spec.quantize == "mixed"
            else None
        )
        with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
            shadow, config = quantize_model(
                shadow,
                config,
                q["group_size"],
                q["bits"],
                mode=q["mode"],
                # mlx-lm's own 3-argument predicate; quantize_model's annotation is older.
                quant_predicate=predicate,  # type: ignore[arg-type]
            )
        for path, module in shadow.named_modules():
            if hasattr(module, "bits") and hasattr(module, "group_size"):
                quant_of[path] = {
                    "group_size": module.group_size,
                    "bits": module.bits,
                    "mode": getattr(module, "mode", "affine"),
                }
    parts = []
    for path, module in model.named_modules():
        own = {k: v for k, v in module.items() if isinstance(v, mx.array) and k[0] != "_"}
        if spec.tie_embeddings and path.rsplit(".", 1)[-1] == "lm_head":
            continue  # a class that builds a head anyway (gemma3) drops it when it is absent
        if own:
            parts.append(_Part(path, module, quant_of.get(path), own))
    parts.sort(key=lambda p: _natural(p.path))
    return parts, config


def _cast(model: nn.Module, dtype: str) -> nn.Module:
    """Floating parameters in `dtype`, but those the family keeps in float32 (mlx-lm's
    cast_predicate, e.g. DeepSeek's expert score bias), as mlx_lm.convert does."""
    from mlx.utils import tree_map_with_path

    keep = getattr(model, "cast_predicate", lambda _: True)
    target = getattr(mx, dtype)

    def cast(name: str, v: mx.array) -> mx.array:
        return v.astype(target) if keep(name) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))
    return model


def _natural(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def _written(part: _Part, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """The tensors a module is stored as, given its arrays: as they are, or packed by
    the module's own to_quantized."""
    module = part.module
    module.update(arrays)
    try:
        if part.quant:
            module = module.to_quantized(**part.quant)
        own = {k: v for k, v in module.items() if isinstance(v, mx.array) and k[0] != "_"}
        prefix = f"{part.path}." if part.path else ""
        return {prefix + k: own[k] for k in sorted(own)}
    finally:
        part.module.update(part.lazy)  # drop the values: the model must not keep them


# ---- values ----------------------------------------------------------------------------


class _Values:
    """Each tensor's values from the seed and its own name, so any tensor can be made
    alone, in any order, and always the same."""

    def __init__(self, spec: DemoSpec, config: dict, parts: list[_Part]) -> None:
        self.spec = spec
        self.dtype = getattr(mx, spec.dtype)
        names = {
            (f"{p.path}.{k}" if p.path else k): v.shape for p in parts for k, v in p.lazy.items()
        }
        self.embed = next(n for n in names if n.endswith("embed_tokens.weight"))
        head = [n for n in names if n.endswith("lm_head.weight")]
        self.head = head[0] if head else None
        # Random logits put the best score on any byte: the output rows are made readable.
        self.out = self.head or self.embed
        self.embed_shape = names[self.embed]

    def __call__(self, part: _Part) -> dict[str, mx.array]:
        out = {}
        for key, lazy in part.lazy.items():
            name = f"{part.path}.{key}" if part.path else key
            values = self._numpy(name, tuple(lazy.shape))
            out[key] = mx.array(values).astype(lazy.dtype)
        return out

    def _numpy(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if self.spec.recite and name in (self.embed, self.head):
            embed, head = _reciting(_init(self.embed, self.embed_shape, self._rng(self.embed)))
            return embed if name == self.embed else head
        values = _init(name, shape, self._rng(name))
        if name == self.out:
            values = _readable_rows(values)
        return values

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([self.spec.seed, zlib.crc32(name.encode())]))


# Embeddings this many times their random size dwarf what 8 random layers add to the
# residual stream; the head's margin for the next word is then ~HEAD_GAIN * sqrt(hidden)
# against noise of ~HEAD_GAIN, so even sampling at temperature 1 follows the passage.
EMBED_GAIN = 16.0
HEAD_GAIN = 2.0


def _reciting(embed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Embedding and head under which each token of the passage predicts the next."""
    ids = passage_ids()
    eos = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    chain = [ord("\n"), *ids, eos]
    if len(set(chain)) != len(chain):
        # A token that occurs twice would need two successors.
        raise ValueError("every word and mark of the demo passage must occur once")
    directions = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    head = np.zeros_like(embed)
    for current, following in itertools.pairwise(chain):
        head[following] += HEAD_GAIN * directions[current]
    return (embed * EMBED_GAIN).astype(np.float32), head.astype(np.float32)


def passage_ids() -> list[int]:
    """The passage as the reciting tokenizer encodes it: one token per word."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(recite=True)).encode(PASSAGE).ids


@functools.cache
def _passage_merges() -> tuple[tuple[str, str], ...]:
    """BPE merges that build every word of the passage left to right."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    merges: list[tuple[str, str]] = []
    for piece, _ in pre.pre_tokenize_str(PASSAGE):
        for k in range(1, len(piece)):
            pair = (piece[:k], piece[k])
            if pair not in merges:
                merges.append(pair)
    return tuple(merges)


def _readable_rows(head: np.ndarray) -> np.ndarray:
    """Zero the output rows of all but letters, space and light punctuation.

    Random logits put the best score on any byte; with the others at exactly 0 the
    winner is almost always a readable one, so the demo writes pseudo-words
    instead of broken UTF-8 and control bytes. The weights stay random.
    """
    keep = np.zeros(head.shape[0], dtype=bool)
    for ch in "abcdefghijklmnopqrstuvwxyz      ,.'":
        keep[ord(ch)] = True
    out = head.copy()
    out[~keep] = 0.0
    # Large enough that even sampling at temperature 1 picks a readable byte; the
    # end-of-turn token is left at zero too, so a demo answer runs to max_tokens.
    out[keep] *= 8.0
    return out


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    # float32 straight from the generator, scaled in place: a tensor costs its own size once.
    values = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        values *= 0.02
        values += 1.0
    elif name.endswith(".bias"):
        values *= 0.02
    elif "embed_tokens" not in name:
        values /= np.float32(np.sqrt(shape[-1]))
    return values


def tokenizer_json(recite: bool = False) -> str:
    """A byte-level BPE over the 256 byte symbols, built and serialised by `tokenizers`;
    reciting, plus one token per word of the passage, after the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet, key=_byte_of))}
    merges = list(_passage_merges()) if recite else []
    if recite:
        vocab.update({t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})
        for a, b in merges:
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return json.dumps(json.loads(tok.to_str()), indent=2, sort_keys=True) + "\n"


def _byte_of(symbol: str) -> int:
    """Order ByteLevel's printable stand-ins by the byte each stands for."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table[symbol]


def tokenizer_config() -> dict:
    added = {
        str(256 + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }


# ---- writing -------------------------------------------------------------------------

_ST_DTYPE = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.uint8: "U8",
    mx.int32: "I32",
}
# Bytes of working memory per element of the largest module while it is made: float32
# from the generator, its MLX copy, the cast and the packed result, with room to spare.
_WORK_BYTES_PER_ELEMENT = 16
_BASE_MEMORY = 300 << 20  # MLX and mlx-lm themselves


@dataclass(frozen=True)
class Needs:
    disk: int  # bytes of the files
    memory: int  # peak bytes of working memory


def needs(spec: DemoSpec) -> Needs:
    """What writing the model takes, from the plan alone (nothing computed)."""
    parts, _ = _plan(spec, make_config(spec))
    return _needs(parts)


def _needs(parts: list[_Part]) -> Needs:
    disk = sum(t.nbytes for p in parts for t in _written(p, p.lazy).values())
    largest = max(sum(v.size for v in p.lazy.values()) for p in parts)
    return Needs(disk=disk + (1 << 20), memory=_BASE_MEMORY + largest * _WORK_BYTES_PER_ELEMENT)


def check_room(directory: Path, need: Needs) -> None:
    """Refuse before writing when the disk or the memory cannot hold the job."""
    import psutil

    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if need.disk > free:
        raise DemoModelError(
            f"the demo model needs {_size(need.disk)} of disk at {directory} and only "
            f"{_size(free)} is free: choose fewer --layers, a smaller --hidden or another "
            "directory"
        )
    available = psutil.virtual_memory().available
    if need.memory > available:
        raise DemoModelError(
            f"writing the demo model needs about {_size(need.memory)} of memory (its largest "
            f"module) and {_size(available)} is available: choose a smaller "
            "--hidden"
        )


_README_TITLE = "# studiotui demo model"


def check_not_another_model(directory: Path) -> None:
    """Refuse a directory that holds anything but an earlier demo model: writing there
    replaces config.json and the tokenizer and deletes model*.safetensors the demo
    does not write, which for a real download means its weights."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise DemoModelError(f"{directory} is a file: choose another directory for the model")
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return
    try:
        ours = (directory / "README.md").read_text().startswith(_README_TITLE)
    except (OSError, UnicodeDecodeError):
        ours = False
    if not ours:
        shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        raise DemoModelError(
            f"{directory} already holds files ({shown}) that are not a studiotui demo "
            "model; writing there would replace or delete them: choose another directory"
        )


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def write_demo_model(
    directory: Path, spec: DemoSpec, stop: Callable[[], bool] | None = None
) -> Path:
    """Write the model; the same spec always gives byte-identical files.

    Refuses (DemoModelError) before writing anything when the disk or memory cannot
    hold it. Nothing half-written is left behind: the files go to a hidden sibling
    directory that becomes `directory` only when complete. `stop` is asked before each
    module: True ends the write with KeyboardInterrupt (the CLI's signal handlers set
    it, so an interrupt is honoured between modules, never lost inside C code)."""
    check_not_another_model(directory)
    config = make_config(spec)
    parts, config = _plan(spec, config)
    check_room(directory, _needs(parts))
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.parent / f".{directory.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # what a killed earlier run left
    partial.mkdir()
    try:
        _write_all(partial, spec, config, parts, stop or (lambda: False))
        _move_into_place(partial, directory)
    except BaseException:  # an interrupt too: no half-written model stays behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return directory


def _write_all(
    directory: Path, spec: DemoSpec, config: dict, parts: list[_Part], stop: Callable[[], bool]
) -> None:
    values = _Values(spec, config, parts)

    def made(part: _Part) -> dict[str, mx.array]:
        if stop():
            raise KeyboardInterrupt
        return values(part)

    _save_weights(directory, parts, made, spec.files, spec.layers)
    _write_json(directory / "config.json", config)
    (directory / "tokenizer.json").write_text(tokenizer_json(spec.recite))
    _write_json(directory / "tokenizer_config.json", tokenizer_config())
    _write_json(
        directory / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    (directory / "README.md").write_text(
        f"{_README_TITLE} ({spec.arch})\n\n"
        "Generated by `studiotui demo-model`: random weights from a fixed seed, "
        "a byte-level BPE tokenizer and a ChatML template. "
        + (
            "Its embedding and head are arranged so that it recites one fixed passage; "
            if spec.recite
            else "It writes noise; "
        )
        + "it exists to exercise loading, sharding and sampling without downloading "
        "a model.\n\n"
        f"Spec: `{json.dumps(spec.__dict__, sort_keys=True)}`\n"
    )


def _move_into_place(partial: Path, directory: Path) -> None:
    if not directory.exists():
        partial.rename(directory)
        return
    # Written over an earlier model: weight files it had and this one lacks would be
    # loaded with it (mlx-lm reads every model*.safetensors), so they go.
    fresh = {f.name for f in partial.iterdir()}
    for old in directory.glob("model*.safetensors*"):
        if old.name not in fresh:
            old.unlink()
    for f in partial.iterdir():
        os.replace(f, directory / f.name)
    partial.rmdir()


def _save_weights(
    directory: Path,
    parts: list[_Part],
    values: Callable[[_Part], dict[str, mx.array]],
    files: int,
    layers: int,
) -> None:
    groups: list[list[_Part]] = [[] for _ in range(max(1, files))]
    for part in parts:
        groups[_file_index(part.path, len(groups), layers)].append(part)
    if len(groups) == 1:
        _write_safetensors(directory / "model.safetensors", groups[0], values)
        return
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        names = _write_safetensors(directory / fname, group, values)
        weight_map.update({name: fname for name in names})
        total += sum(t.nbytes for p in group for t in _written(p, p.lazy).values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(directory / "model.safetensors.index.json", index)


def _write_safetensors(
    path: Path, parts: list[_Part], values: Callable[[_Part], dict[str, mx.array]]
) -> list[str]:
    """A safetensors file written one module at a time: the header from the plan, then
    each module's tensors as they are made."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for part in parts:
        for name, t in _written(part, part.lazy).items():
            header[name] = {
                "dtype": _ST_DTYPE[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for part in parts:
            for name, t in _written(part, values(part)).items():
                mx.eval(t)
                # mx.array has the buffer protocol; its stub does not declare it.
                data = memoryview(t).cast("B")  # type: ignore[arg-type]
                if len(data) != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                    raise DemoModelError(f"{name} came out with a size other than planned")
                f.write(data)
            mx.clear_cache()
    return [n for n in header if n != "__metadata__"]


def _file_index(path: str, files: int, layers: int) -> int:
    """Layers spread evenly over the files; the embedding in the first, the head in the last."""
    parts = path.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return min(files - 1, layer * files // layers)
    return 0 if "embed_tokens" in path else files - 1


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
