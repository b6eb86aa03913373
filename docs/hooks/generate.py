"""Pages written from the code when the docs site is built (mkdocs `hooks:`).

Two markers in a page's Markdown are replaced, so these pages cannot drift from what
they describe:

* `<!-- generated: cli-reference -->`: every verb of `studiotui` (and every sub-verb),
  its usage and each option with its default, rendered from the argparse parsers
  (`studiotui/cli/main.py` `build_parser`), the same ones `--help` prints.
* `<!-- generated: bench-table PATH -->`: the figures of a saved `studiotui bench
  --json` run (PATH relative to docs/) as a table, each row with what it measures and
  its goal (`FIELDS`).

`python docs/hooks/generate.py cli` or `python docs/hooks/generate.py bench FILE`
prints either to the terminal, to read without building the site.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
CLI_MARKER = "<!-- generated: cli-reference -->"
BENCH_MARKER = re.compile(r"<!-- generated: bench-table (\S+) -->")

# What each figure of `studiotui bench --json` measures, and its goal where it has one.
# The performance page's table shows the figures a run reported in this order; a key
# named here must be one the bench reports (tests/unit/test_repo.py checks it).
FIELDS: dict[str, tuple[str, str]] = {
    "single_tps": ("mlx-lm's own generate loop in one process, tokens/s", ""),
    "pipe1_tps": ("this engine on one node, tokens/s (full run only)", ""),
    "pipe1_ratio": ("`pipe1_tps` ÷ the single process run beside it", ""),
    "pipe2_tps": ("2 pipeline shards on 2 local nodes, tokens/s", ""),
    "pipe2_ratio": ("2 shards ÷ the single process run beside it (median of pairs)", "≥ 0.95"),
    "pipe4_tps": ("4 pipeline shards, tokens/s", ""),
    "pipe4_ratio": ("4 shards ÷ the single process run beside it", "≥ 0.9"),
    "streams4_ratio": ("4 requests in flight on 2 shards ÷ 1, aggregate tokens/s", "≥ 1.8"),
    "mlx_ring2_tps": ("mlx-lm's `pipeline()` on its ring backend, 2 processes", "< `pipe2_tps`"),
    "hop_us_p50": ("a frame's hop: a stage's send call to the next stage's recv, µs", ""),
    "bare_hop_us": ("one bare CURVE ZeroMQ message between two idle processes, µs", ""),
    "hop_over_bare": ("`hop_us_p50` ÷ `bare_hop_us`", "≤ 1.2"),
    "frame_overhead_us_p50": ("a stage's Python per frame, recv to send less MLX, µs", ""),
    "ring_overhead_us_p50": ("a token's time less every stage's MLX evaluation, µs", ""),
    "ttft_single_ms": ("first token of a 612-token prompt, mlx-lm in one process, ms", ""),
    "ttft_pipe2_ms": ("the same on 2 shards (default 512-token chunk), ms", ""),
    "ttft_pipe2_ratio": ("`ttft_pipe2_ms` ÷ `ttft_single_ms`, time, median of pairs", "≤ 1"),
    "moe_ttft_ratio": (
        "first token of 600 tokens, 4-bit bfloat16 qwen3_moe on 2 shards ÷ mlx-lm, time",
        "≤ 1",
    ),
    "moe_pipe2_ratio": ("4-bit qwen3_moe on 2 shards ÷ mlx-lm beside it", "≥ 0.95"),
    "moe_pipe2_floor_ratio": ("the same two shards in two bare processes ÷ mlx-lm", ""),
    "moe_pipe2_over_floor": ("`moe_pipe2_ratio` ÷ `moe_pipe2_floor_ratio`", ""),
    "structured_tok_ratio": (
        "decode tokens/s with a `json_schema` response format ÷ without, same prompt",
        "≥ 0.9",
    ),
    "batch8_ratio": ("8 requests at once on 2 shards ÷ 1 request", "≥ mlx-lm's"),
    "mlx_batch8_ratio": ("mlx-lm's `BatchGenerator`, 8 prompts ÷ its one stream", ""),
    "kv8_context_ratio": (
        "the context the planner offers with `--kv-bits 8` ÷ at full precision, same nodes "
        "(bfloat16, 128-wide heads)",
        "≥ 1.8",
    ),
    "tp2_tps": ("a 2-node tensor group, tokens/s", ""),
    "tp2_over_mlx": ("the tensor group ÷ mlx-lm's own tensor parallel run beside it", "≥ 1"),
    "tokens_match": ("every pipeline gives the single process's greedy tokens", "true"),
    "tui_idle_cpu_pct": ("the idle dashboard watching 4 nodes, % of one core", "< 5 %"),
    "api_overhead_ratio": ("8 API clients ÷ the same requests sent direct", "≥ 0.95"),
    "provision4_ratio": ("provisioning 4 nodes ÷ 1 node, real sshd (full run only)", "≤ 1.5"),
    "reprovision_s": ("provisioning again with nothing changed, s (full run only)", ""),
    "copy_operator_sftp_mb_s": ("model files operator → node over SFTP, MB/s", ""),
    "copy_node_to_node_mb_s": ("model files node → node, CURVE ZeroMQ, MB/s", ""),
    "copy_mlx_share_mb_s": ("`mlx_lm.share` on the same files, MB/s", ""),
    "finetune2_ratio": ("LoRA training tokens/s, 2 nodes ÷ 1 (full run only)", "≥ 1.5"),
    "bench_seconds": ("the run's own length, s", ""),
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _global(parser: argparse.ArgumentParser) -> set[argparse.Action]:
    """A verb's copies of the global options (`add_global_options`), said once at the top."""
    return {
        action
        for group in parser._action_groups
        if (group.title or "").startswith("global options")
        for action in group._group_actions
    }


def _options(parser: argparse.ArgumentParser, skip: set[argparse.Action]) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction) or action in skip:
            continue
        if action.option_strings:
            name = ", ".join(f"`{flag}`" for flag in action.option_strings)
            if action.nargs != 0:
                metavar = formatter._metavar_formatter(action, action.dest.upper())(1)[0]
                name += f" `{metavar}`"
        else:
            name = f"`{formatter._metavar_formatter(action, action.dest)(1)[0]}`"
        said = formatter._expand_help(action) if action.help else ""
        default = action.default
        if (
            action.option_strings
            and action.nargs != 0
            and default not in (None, argparse.SUPPRESS, [])
            and "default" not in said
        ):
            said += f" (default: {default})"
        rows.append(f"| {_cell(name)} | {_cell(said)} |")
    return rows


def _verb(parser: argparse.ArgumentParser, words: list[str], helped: str) -> list[str]:
    out = [f"## `{' '.join(words)}`", ""]
    if parser.description or helped:
        out += [_cell(parser.description or helped), ""]
    usage = parser.format_usage().removeprefix("usage: ").strip()
    out += ["```text", re.sub(r"\s+", " ", usage), "```", ""]
    rows = _options(parser, _global(parser) if len(words) > 1 else set())
    if rows:
        out += ["| argument | what it does |", "| --- | --- |", *rows, ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            said = {a.dest: a.help or "" for a in action._choices_actions}
            for name, child in action.choices.items():
                out += _verb(child, [*words, name], said.get(name, ""))
    return out


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """Every verb of the parser as Markdown: a section each, usage and options."""
    if parser is None:
        from studiotui.cli.main import build_parser

        parser = build_parser()
    top = _verb(parser, ["studiotui"], "")
    return "\n".join(top).rstrip() + "\n"


def _value(value: Any) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return " / ".join(f"{k}: {_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return " / ".join(_value(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def bench_table(figures: dict[str, Any]) -> str:
    """A saved `studiotui bench --json` run as a Markdown table, in FIELDS' order."""
    lines = ["| figure | value | what it measures | goal |", "| --- | --- | --- | --- |"]
    for key, (what, goal) in FIELDS.items():
        if key in figures:
            lines.append(f"| `{key}` | {_value(figures[key])} | {_cell(what)} | {_cell(goal)} |")
    return "\n".join(lines) + "\n"


def render(markdown: str) -> str:
    """A page with its markers replaced (pages without one come back unchanged)."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())

    def table(found: re.Match[str]) -> str:
        figures = json.loads((DOCS / found.group(1)).read_text(encoding="utf-8"))
        return bench_table(figures)

    return BENCH_MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs' hook: called with each page's Markdown before it is rendered."""
    return render(markdown)


if __name__ == "__main__":
    what = sys.argv[1:2]
    if what == ["cli"]:
        print(cli_reference(), end="")
    elif what == ["bench"] and len(sys.argv) == 3:
        print(bench_table(json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))), end="")
    else:
        sys.exit("usage: python docs/hooks/generate.py cli | bench FILE.json")
