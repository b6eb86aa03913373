"""Deterministic demo models that `mlx_lm.load` loads unchanged.

No model can be downloaded here, so the project writes its own: the real mlx-lm
model class of the chosen family decides the tensor names and shapes, numpy's
PCG64 generator (stable across versions and platforms) fills them from the seed,
and the tokenizer is a real byte-level BPE `tokenizer.json` with a ChatML
template. The weights are random: the text a demo model writes is noise, but
every code path (loading, sharding, KV caches, sampling, detokenising) is the
one a real model takes.

With `recite`, the model writes a fixed passage instead of noise, so a newcomer's
first chat reads as an answer. Nothing is trained: the tokenizer gets one BPE
token per word of the passage, the embedding of each is scaled up so the random
layers barely move it, and the output head maps each token's direction to the
next token of the passage (the chat template's last "\n" to its first word, its
last word to end-of-turn). Every layer still runs on every token.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
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

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {', '.join(FAMILIES)}")
        if self.layers < 1 or self.hidden < 8 or self.hidden % self.heads:
            raise ValueError("need layers >= 1 and hidden a multiple of heads")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.recite and self.tie_embeddings:
            raise ValueError("a reciting demo needs its own output head (no tied embeddings)")


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
    return config


_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes exactly as the family's mlx-lm class declares them."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Construction is lazy in MLX: no weight memory is touched here.
    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def make_weights(config: dict, seed: int, dtype: str, recite: bool = False) -> dict[str, mx.array]:
    rng = np.random.Generator(np.random.PCG64(seed))
    weights: dict[str, np.ndarray] = {}
    out_name = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
    for name, shape in sorted(parameter_shapes(config).items()):
        values = _init(name, shape, rng)
        if name == out_name and not recite:
            values = _readable_rows(values)
        weights[name] = values
    if recite:
        embed, head = _reciting(weights["model.embed_tokens.weight"])
        weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    return {name: mx.array(v).astype(getattr(mx, dtype)) for name, v in weights.items()}


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
    if name.endswith("norm.weight"):
        return (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if "embed_tokens" in name:
        return rng.standard_normal(shape).astype(np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


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


def write_demo_model(directory: Path, spec: DemoSpec) -> Path:
    """Write the model; the same spec always gives byte-identical files."""
    directory.mkdir(parents=True, exist_ok=True)
    config = make_config(spec)
    weights = make_weights(config, spec.seed, spec.dtype, spec.recite)
    _save_weights(directory, weights, spec.files, spec.layers)
    _write_json(directory / "config.json", config)
    (directory / "tokenizer.json").write_text(tokenizer_json(spec.recite))
    _write_json(directory / "tokenizer_config.json", tokenizer_config())
    _write_json(
        directory / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    (directory / "README.md").write_text(
        f"# studiotui demo model ({spec.arch})\n\n"
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
    return directory


def _save_weights(directory: Path, weights: dict[str, mx.array], files: int, layers: int) -> None:
    if files <= 1:
        mx.save_safetensors(
            str(directory / "model.safetensors"), weights, metadata={"format": "mlx"}
        )
        return
    groups: list[dict[str, mx.array]] = [{} for _ in range(files)]
    for name, value in weights.items():
        groups[_file_index(name, files, layers)][name] = value
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        mx.save_safetensors(str(directory / fname), group, metadata={"format": "mlx"})
        weight_map.update({name: fname for name in group})
    total = sum(v.nbytes for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(directory / "model.safetensors.index.json", index)


def _file_index(name: str, files: int, layers: int) -> int:
    """Layers spread evenly over the files; the embedding in the first, the head in the last."""
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return min(files - 1, layer * files // layers)
    return 0 if "embed_tokens" in name else files - 1


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
