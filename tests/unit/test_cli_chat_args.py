"""`studiotui chat`'s numbers are refused by argparse naming the flag, before the
cluster is asked (a bad --max-tokens used to come back from the tail shard as
"max_tokens must be 1..1048576", the API's field name)."""

from __future__ import annotations

import pytest

from studiotui.cli.main import build_parser


@pytest.mark.parametrize("value", ["0", "-3", "ten", "2.5"])
def test_chat_max_tokens_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["chat", "hi", "--max-tokens", value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-tokens: wants a whole number of at least 1" in err


def test_chat_max_tokens_taken() -> None:
    args = build_parser().parse_args(["chat", "hi", "--max-tokens", "40"])
    assert args.max_tokens == 40
    assert build_parser().parse_args(["chat", "hi"]).max_tokens == 256
