"""The command line: every verb drives the same Controller the TUI uses.

Verbs import their heavy parts (MLX, Textual, the controller: seconds each on a small
machine) inside the function that runs them, here and in the modules of `studiotui.cli`,
so `studiotui --help` and the quick verbs answer at once; no import there dodges a loop
(lint-imports checks the layers with them in place)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from studiotui import __version__
from studiotui.cli.argtypes import gigabytes, port, positive, positive_float, whole
from studiotui.core.errors import StudioError, UserError
from studiotui.core.inventory import DEFAULT_CONTROL_PORT
from worker.shared.kv_quant import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES
from worker.shared.protocol.limits import DEFAULT_STREAMS

DEFAULT_LOCAL_NODES = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="studiotui",
        description="Cluster manager and chat client for desk clusters of Apple Silicon Macs.",
    )
    p.add_argument("--version", action="version", version=f"studiotui {__version__}")
    add_global_options(p, on_verb=False)
    # One word in the usage line; the list of commands is below it, each with its help.
    sub = p.add_subparsers(dest="verb", metavar="COMMAND")
    from studiotui.cli import provision_cmd

    provision_cmd.add_parsers(sub)  # provision, restart

    up = sub.add_parser("up", help="start agents (with --local N: a simulated cluster here)")
    up.add_argument(
        "--local", type=positive, metavar="N", help="start N simulated nodes on this machine"
    )
    up.add_argument(
        "--memory-gb", type=positive_float, default=None, help="memory each local node advertises"
    )
    up.add_argument(
        "--port",
        type=port,
        default=DEFAULT_CONTROL_PORT,
        help="control port of the local nodes, to run a second simulated cluster beside one "
        f"(default {DEFAULT_CONTROL_PORT})",
    )

    down = sub.add_parser("down", help="stop agents")
    down.add_argument("nodes", nargs="*", help="nodes to stop (default: all)")
    down.add_argument(
        "--yes",
        action="store_true",
        help="stop even a node running a rank of a job (which ends the job on every node)",
    )
    down.add_argument(
        "--all",
        action="store_true",
        help="also stop the API servers (serve) and browser views (web, with their tabs' "
        "dashboards) running for this STUDIOTUI_HOME",
    )

    status = sub.add_parser("status", help="nodes and placements")
    status.add_argument("--json", action="store_true")

    place = sub.add_parser("place", help="split a model over nodes and load it")
    place.add_argument(
        "model_dir", type=Path, help="a model directory, or a model's name in the catalog"
    )
    place.add_argument("--nodes", help="a group name or comma list of nodes (default: all up)")
    place.add_argument("--name", help="placement name (default: the model directory's name)")
    place.add_argument("--prefill-chunk", type=positive, default=512)
    place.add_argument(
        "--context", type=positive, default=4096, help="context tokens to reserve KV for"
    )
    place.add_argument(
        "--streams",
        type=positive,
        default=None,
        help="requests served at once, each with the whole context (KV is reserved for all; "
        f"default: as many as fit, up to {DEFAULT_STREAMS}); more wait in a short queue or "
        "are refused as busy",
    )
    place.add_argument(
        "--tensor",
        type=positive,
        default=None,
        help="nodes per stage: each stage a tensor group of N nodes (1: a pipeline; "
        "default: the fastest shape that fits, by the forecast)",
    )
    place.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=0,
        help="keep the KV cache quantized to 8 or 4 bits (mlx-lm's QuantizedKVCache): "
        "about 1.9x or 3.5x the context in the same memory; sliding-window, "
        "linear-attention and MLA caches stay full (the preview says which)",
    )
    place.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=DEFAULT_KV_GROUP_SIZE,
        help="values per quantization scale with --kv-bits (default: %(default)s)",
    )
    place.add_argument(
        "--prompt-cache",
        type=gigabytes,
        default=None,
        metavar="GB",
        help="memory for the prompt cache, over the whole placement, counted in each "
        "node's memory like weights and KV (default: what the plan can spare, at most "
        "half of what is left free and 4 whole contexts' KV; 0: none)",
    )
    place.add_argument(
        "--prompt-cache-disk",
        type=gigabytes,
        default=None,
        metavar="GB",
        help="disk under each node's workdir for prompt-cache entries pushed out of "
        "memory, over the whole placement, checked against each node's free disk "
        "(default: 4x the memory budget, at most half of a node's free disk; 0: none)",
    )
    place.add_argument("--dry-run", action="store_true", help="show the plan, load nothing")
    place.add_argument(
        "--adapter",
        help="an mlx-lm LoRA/DoRA adapter (directory, or a name in STUDIOTUI_HOME/adapters) "
        "trained on this model: the shards apply it (placement name MODEL+ADAPTER)",
    )
    place.add_argument(
        "--draft",
        metavar="DRAFT_DIR|lookup",
        help="speculative decoding: a small draft model of the same tokenizer (loaded whole "
        "on the head node), or 'lookup' to guess from the prompt and answer so far",
    )
    place.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        metavar="K",
        help="a draft model's guesses per verify step (default 4); lookup starts at 2 and "
        "doubles up to 16 while its guesses are kept",
    )

    fetch = sub.add_parser(
        "fetch", help="put a model's files on nodes ahead of placing it, each node its share"
    )
    fetch.add_argument(
        "source",
        help="a Hugging Face repo id (org/name), a model directory, or a model's catalog name",
    )
    fetch.add_argument("--nodes", help="a group name or comma list of nodes (default: all up)")
    fetch.add_argument("--revision", default="main", help="hub branch, tag or commit")
    fetch.add_argument(
        "--cache-dir", help="hub cache on the nodes (default: each node's own Hugging Face cache)"
    )

    unload = sub.add_parser("unload", help="unload a placement and free its memory")
    unload.add_argument("name")

    cache = sub.add_parser("cache", help="a placement's prompt (prefix) cache")
    cache.add_argument("action", choices=["clear"], help="clear: empty it on every node")
    cache.add_argument("placement", nargs="?", help="which placement (default: every one)")

    chat = sub.add_parser("chat", help="send one prompt and stream the answer")
    chat.add_argument("prompt")
    chat.add_argument("--placement")
    chat.add_argument(
        "--max-tokens", type=positive, default=256, help="the most tokens to answer with"
    )
    chat.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default) samples greedily"
    )
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, (0, 1]")
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat.add_argument("--raw", action="store_true", help="no chat template: the prompt as is")

    logs = sub.add_parser("logs", help="a node agent's log")
    logs.add_argument("node")
    logs.add_argument("--lines", type=positive, default=100)
    logs.add_argument("--follow", action="store_true")

    _add_demo_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="measure studiotui's own engine here on generated models, runs paired "
        "side by side (your cluster: see benchmark)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a shorter run: fewer tokens, no provisioning or fine-tuning",
    )
    bench.add_argument("--json", action="store_true", help="one JSON object")
    bench.add_argument(
        "--soak",
        action="store_true",
        help="instead: a cancel storm, then 200 requests over 8 API clients (lost, mixed, memory)",
    )
    bench.add_argument(
        "--speculative",
        action="store_true",
        help="instead: only the speculative decoding rows (spec_draft_ratio, "
        "spec_lookup_ratio, spec_miss_ratio, beside mlx-lm's own)",
    )
    from studiotui.cli import tune_cmd

    tune_cmd.add_parsers(sub)  # finetune, jobs
    from studiotui.cli.benchmark_cmd import add_parser as add_benchmark_parser

    add_benchmark_parser(sub)
    from studiotui.cli.serve import add_serve_parser

    add_serve_parser(sub)
    from studiotui.cli.web import add_web_parser

    add_web_parser(sub)
    from studiotui.cli.adapter_cmd import add_adapter_parsers

    add_adapter_parsers(sub)
    for verb_parser in sub.choices.values():
        add_global_options(verb_parser, on_verb=True)
    return p


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    from worker.shared.demo_model import FAMILIES, QUANTIZE

    demo = sub.add_parser(
        "demo-model",
        help="write a deterministic demo model directory",
        description="Write a tiny model of a real mlx-lm family with random weights from a "
        "fixed seed: the same options always give byte-identical files, and mlx_lm.load "
        "loads the directory unchanged. It recites one passage (or, with --noise, writes "
        "random text); "
        "it exists to try placing, sharding and chatting without a download. The files are "
        "written one module at a time, after checking free disk and memory; an interrupted "
        "write leaves nothing behind.",
    )
    demo.add_argument("dir", type=Path, help="directory to write (created; files replaced)")
    demo.add_argument(
        "--arch",
        default="llama",
        choices=FAMILIES,
        metavar="FAMILY",
        help=f"model family, as config.json's model_type: {', '.join(FAMILIES)} (default: llama)",
    )
    demo.add_argument(
        "--layers", type=positive, default=8, help="decoder layers: what shards split (default: 8)"
    )
    demo.add_argument("--hidden", type=positive, default=256, help="hidden size (default: 256)")
    demo.add_argument("--heads", type=positive, default=8, help="attention heads (default: 8)")
    demo.add_argument(
        "--kv-heads",
        type=positive,
        default=4,
        help="key/value heads, dividing --heads (default: 4)",
    )
    demo.add_argument(
        "--intermediate",
        type=positive,
        default=None,
        help="width of the dense MLP (default: 8/3 of --hidden)",
    )
    demo.add_argument(
        "--experts",
        type=positive,
        default=4,
        help="routed experts of a mixture-of-experts family, 2 active a token (default: 4)",
    )
    demo.add_argument(
        "--seed", type=whole, default=0, help="random seed: same seed, same weights (default: 0)"
    )
    demo.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="weight data type, of what is not quantized (default: bfloat16; float32 for a "
        "mixture of "
        "experts left unquantized, which MLX's CPU backend multiplies only in float32)",
    )
    demo.add_argument(
        "--quantize",
        choices=QUANTIZE,
        default=None,
        help="pack the weights as mlx-lm's convert does: 4 or 8 (affine bits), mxfp4, "
        "mxfp8, nvfp4, or mixed (mlx-lm's mixed_4_6 recipe, per-module overrides); "
        "default: not quantized",
    )
    demo.add_argument(
        "--group-size",
        type=int,
        choices=[32, 64, 128],
        default=None,
        help="group size of affine quantization (default: 64); --hidden must be a multiple",
    )
    demo.add_argument(
        "--files",
        type=positive,
        default=1,
        help="safetensors files, split by layer with an index as big downloads are (default: 1)",
    )
    reads = demo.add_mutually_exclusive_group()
    reads.add_argument(
        "--recite",
        action="store_true",
        help="write a fixed passage, so a chat reads as an answer (the default)",
    )
    reads.add_argument(
        "--noise",
        action="store_true",
        help="keep the random output head: the model writes noise, as random weights do "
        "(placing it says so)",
    )


def add_global_options(p: argparse.ArgumentParser, on_verb: bool) -> None:
    """The options that are not a verb's own, accepted before or after the verb.

    On a verb they default to SUPPRESS, so a value given before the verb is not
    overwritten by the verb's default when argparse merges the two namespaces.
    A verb with its own option of the same name (serve's --api-key) keeps its own.
    """
    group = p.add_argument_group("global options (before or after the verb)") if on_verb else p
    suppress = {"default": argparse.SUPPRESS} if on_verb else {}
    options: list[tuple[tuple[str, ...], dict[str, Any]]] = [
        (("-i", "--inventory"), {"type": Path, "help": "cluster.toml to use", **suppress}),
        (
            ("--trust-inventory",),
            {
                "action": "store_true",
                "help": "use a ./cluster.toml whose local nodes run another python or write "
                "outside STUDIOTUI_HOME",
                **suppress,
            },
        ),
        (
            ("--serve",),
            {
                "type": _host_port,
                "metavar": "[HOST:]PORT",
                "help": "with the dashboard: also serve the HTTP API (OpenAI, Anthropic, Ollama) "
                "from it",
                **suppress,
            },
        ),
        (
            ("--api-key",),
            {
                "help": "with --serve: require this bearer key (default: $STUDIOTUI_API_KEY)",
                "default": os.environ.get("STUDIOTUI_API_KEY"),
                **suppress,
            },
        ),
        (
            ("--api-key-file",),
            {
                "type": Path,
                "metavar": "FILE",
                "help": "with --serve: require one of the 'NAME KEY' lines of FILE "
                "(read again when it changes)",
                **suppress,
            },
        ),
    ]
    if on_verb:
        version = {"action": "version", "version": f"studiotui {__version__}"}
        options.append((("--version",), version))
    for flags, kwargs in options:
        # argparse refuses an option string a verb already has: the verb's own wins.
        with contextlib.suppress(argparse.ArgumentError):
            group.add_argument(*flags, **kwargs)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--serve wants [HOST:]PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def home_dir() -> Path:
    from studiotui.core.inventory import studiotui_home

    home = studiotui_home(os.environ)
    try:
        home.mkdir(parents=True, exist_ok=True)
        # Conversations, keys and inventories live here: the operator's alone.
        home.chmod(0o700)
        # Write a file now, not on the first answer or key: a read-only disk or a
        # full one is said before anything is started.
        fd, probe = tempfile.mkstemp(dir=home, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"studiotui's home {home} is not a folder it can write "
            f"({exc.strerror or exc}); nothing was started",
            "set STUDIOTUI_HOME to a writable folder, or fix that one",
        ) from None
    return home


# The module that runs each verb (its `cmd_<verb>`), imported when the verb is run so
# `studiotui --help` loads none of them. `provision_cmd` runs down and logs too: it
# handles SSH nodes and hands local ones to `nodes_cmd`.
VERB_MODULES: dict[str, str] = {
    "tui": "tui_cmd",
    "provision": "provision_cmd",
    "restart": "provision_cmd",
    "down": "provision_cmd",
    "logs": "provision_cmd",
    "up": "nodes_cmd",
    "status": "status_cmd",
    "place": "place_cmd",
    "fetch": "place_cmd",
    "unload": "place_cmd",
    "cache": "place_cmd",
    "chat": "chat_cmd",
    "demo-model": "demo_cmd",
    "bench": "bench_cmd",
    "finetune": "tune_cmd",
    "jobs": "tune_cmd",
    "benchmark": "benchmark_cmd",
    "serve": "serve",
    "web": "web",
    "fuse": "adapter_cmd",
    "adapter": "adapter_cmd",
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    verb = args.verb or "tui"
    if verb != "tui" and getattr(args, "serve", None):
        parser.error(
            f"--serve works with the dashboard only (studiotui --serve PORT); "
            f"for the API on its own run `studiotui serve`, not with `{verb}`"
        )
    module = importlib.import_module(f"studiotui.cli.{VERB_MODULES[verb]}")
    handler = getattr(module, f"cmd_{verb.replace('-', '_')}")
    try:
        result = handler(args, home_dir())
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    except StudioError as exc:
        print(f"studiotui: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
