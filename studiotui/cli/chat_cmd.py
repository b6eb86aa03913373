"""`chat`: one prompt, the answer streamed."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from studiotui.cli.args import inventory_of
from studiotui.cli.nodes_cmd import nobody_home, start_hint
from studiotui.cli.output import errors
from studiotui.cluster.controller import GenerationError
from studiotui.cluster.session import open_controller
from studiotui.core.errors import UserError
from studiotui.core.text import printable
from worker.shared.protocol import control


async def cmd_chat(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    if args.raw:
        request: dict[str, Any] = {"prompt": args.prompt}
    else:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        request = {"messages": [*msgs, {"role": "user", "content": args.prompt}]}
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
    }
    try:
        async with open_controller(inv, home, ask=0.3 if nobody_home(inv) else 2.0) as ctl:
            # The whole way to an answer, once, rather than one step per failed command.
            place = (
                "place a model (`studiotui place MODEL_DIR`; `studiotui demo-model DIR` writes one)"
            )
            if not any(n.state == "up" for n in ctl.state.nodes):
                raise UserError(
                    f"no node is up: start the cluster with {start_hint(inv)}, {place}, then chat"
                )
            if not ctl.state.placements:
                raise UserError(f"no placement yet: {place}, then chat")
            done: control.Done | None = None
            try:
                async for msg in ctl.generate(args.placement, request, params):
                    match msg:
                        case control.Delta():
                            # As the dashboard's chat: a model's ESC must not drive the
                            # terminal.
                            sys.stdout.write(printable(msg.text))
                            sys.stdout.flush()
                        case control.Done():
                            done = msg
            except asyncio.CancelledError:
                # Ctrl-C: the request is cancelled on the cluster as the generator closes;
                # the shell's prompt goes on a line of its own.
                sys.stdout.write("\n")
                sys.stdout.flush()
                errors.print("[dim]stopped: the answer was cancelled[/]")
                raise
            sys.stdout.write("\n")
            t = done.timings if done else {}
            u = done.usage if done else {}
            # Speculative decoding: the share of guesses kept, beside the speed it brought.
            spec = u.get("completion_tokens_details") or {}
            made = spec.get("accepted_prediction_tokens", 0) + spec.get(
                "rejected_prediction_tokens", 0
            )
            kept = (
                f"{spec['accepted_prediction_tokens'] / made:.0%} of guesses kept, " if made else ""
            )
            errors.print(
                f"[dim]{u.get('prompt_tokens', 0)} tokens in, {u.get('completion_tokens', 0)} out, "
                f"first token {t.get('ttft_ms', 0):.0f} ms, {t.get('decode_tps', 0):.1f} tok/s, "
                f"{kept}finish: {done.finish_reason if done else '?'}[/]"
            )
    except GenerationError as exc:
        raise UserError(str(exc)) from None
    return 0
