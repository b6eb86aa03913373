"""`studiotui demo-model`: every family, deterministic, bounded memory, refusals, clean-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx_lm
import pytest

from studiotui.cli.main import main
from worker.shared.demo_model import DemoModelError, DemoSpec, write_demo_model

CLI = [sys.executable, "-m", "studiotui"]


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUDIOTUI_HOME": str(tmp_path / "home")}
    return subprocess.run(
        [*CLI, "demo-model", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize(
    ("arch", "quantize"), [("qwen3_moe", "mixed"), ("deepseek_v3", "4"), ("gpt_oss", "mxfp4")]
)
def test_the_same_spec_gives_byte_identical_files(tmp_path: Path, arch: str, quantize: str) -> None:
    spec = DemoSpec(arch=arch, layers=3, hidden=64, heads=4, kv_heads=2, quantize=quantize)
    a = write_demo_model(tmp_path / "a", spec)
    b = write_demo_model(tmp_path / "b", spec)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    other = write_demo_model(tmp_path / "c", DemoSpec(**{**spec.__dict__, "seed": 1}))
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    # Written again over itself: the same bytes, and no stray files.
    again = write_demo_model(a, spec)
    assert sorted(p.name for p in again.iterdir()) == files


def test_demo_model_help_describes_every_option(tmp_path: Path) -> None:
    out = subprocess.run([*CLI, "demo-model", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    options = [
        "--arch",
        "--layers",
        "--hidden",
        "--heads",
        "--kv-heads",
        "--intermediate",
        "--experts",
        "--seed",
        "--dtype",
        "--quantize",
        "--group-size",
        "--files",
        "--recite",
    ]
    for option in options:
        # Each option is followed by words saying what it does, not just its metavar.
        after = text.split(f" {option} ", 1)[1] if f" {option} " in text else ""
        assert len(after.split()) > 3, f"{option} is not described"
    assert "qwen3_moe" in text and "mxfp4" in text and "mixed" in text


def test_writing_takes_a_fraction_of_the_model_in_memory(tmp_path: Path) -> None:
    # A 140 MB model (hidden 1024, 6 layers) written in a fresh process, after a 1-layer
    # one has paid for imports, thread pools and caches: the peak above that stays far
    # below the model's size (it was 4.5x; it is the largest module, a few MB, now).
    code = (
        "import resource, sys, psutil\n"
        "from pathlib import Path\n"
        "from worker.shared.demo_model import DemoSpec, write_demo_model\n"
        "spec = DemoSpec(layers=1, hidden=1024, heads=8, kv_heads=4)\n"
        "write_demo_model(Path(sys.argv[1]) / 'warm', spec)\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "spec = DemoSpec(layers=6, hidden=1024, heads=8, kv_heads=4)\n"
        "write_demo_model(Path(sys.argv[1]) / 'm', spec)\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "scale = 1 if sys.platform == 'darwin' else 1024\n"
        "print(base * scale, peak * scale)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    base, peak = map(int, out.stdout.split())
    size = (tmp_path / "m" / "model.safetensors").stat().st_size
    assert size > 130e6
    assert peak - base < size / 4, f"peak {peak - base} bytes over the warm-up for {size}"


def test_a_model_too_big_for_the_disk_is_refused_before_writing(tmp_path: Path) -> None:
    # Terabytes in a few wide layers: as far past any disk, and quick to size (the
    # size comes from the lazy module tree, which grows with the layer count).
    out = run_cli(tmp_path, str(tmp_path / "huge"), "--layers", "64", "--hidden", "65536")
    assert out.returncode == 2
    assert "of disk at" in out.stderr and "is free" in out.stderr
    assert "fewer --layers" in out.stderr
    assert not any(tmp_path.glob("*huge*")), "nothing may be written"
    with pytest.raises(DemoModelError, match="not a multiple of the quantization group"):
        DemoSpec(hidden=96, heads=8, quantize="4", group_size=64)


def test_a_folder_holding_another_model_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A real download (or any files) in DIR is not a demo to write over: its config
    and weights would be replaced and its other model*.safetensors deleted."""
    real = tmp_path / "Qwen3-30B-A3B"
    real.mkdir()
    files = {"config.json": '{"model_type": "qwen3_moe"}', "model-00002-of-00002.safetensors": "x"}
    for name, text in files.items():
        (real / name).write_text(text)
    out = run_cli(tmp_path, str(real), "--layers", "2", "--hidden", "64", "--heads", "4")
    assert out.returncode == 2, out.stdout
    assert f"{real} already holds files" in out.stderr and "another directory" in out.stderr
    assert "Traceback" not in out.stderr
    assert {p.name: p.read_text() for p in real.iterdir()} == files
    assert not any(tmp_path.glob(".*partial"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_write_leaves_no_directory(tmp_path: Path, sig: signal.Signals) -> None:
    target = tmp_path / "big"
    partial = tmp_path / ".big.partial"
    env = {**os.environ, "STUDIOTUI_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [*CLI, "demo-model", str(target), "--layers", "40", "--hidden", "512"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (partial / "model.safetensors").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (partial / "model.safetensors").exists(), "the write never started"
        assert not target.exists(), "the directory appears only when complete"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # the process this test started
            proc.wait()
    assert proc.returncode == 130
    assert not target.exists() and not partial.exists()


def test_the_command_writes_a_quantized_moe_model_mlx_lm_loads(tmp_path: Path) -> None:
    model = tmp_path / "oss"
    out = run_cli(
        tmp_path, str(model), "--arch", "gpt_oss", "--quantize", "mxfp4", "--layers", "2",
        "--hidden", "64", "--heads", "4", "--kv-heads", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "wrote gpt_oss demo model (2 layers, bfloat16, mxfp4" in " ".join(out.stdout.split())
    config = json.loads((model / "config.json").read_text())
    assert config["quantization"]["mode"] == "mxfp4"
    loaded, _ = mlx_lm.load(str(model))
    assert len(loaded.layers) == 2
    # An unquantized mixture of experts defaults to float32: MLX's CPU backend runs it.
    moe = tmp_path / "moe"
    out = run_cli(tmp_path, str(moe), "--arch", "qwen3_moe", "--layers", "1", "--hidden", "32",
                  "--heads", "2", "--kv-heads", "1")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads((moe / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--heads", "0"], "argument --heads: wants a whole number of at least 1, got '0'"),
        (["--kv-heads", "0"], "argument --kv-heads: wants a whole number of at least 1"),
        (["--seed", "-1"], "argument --seed: wants a whole number (0 or more), got '-1'"),
        (["--intermediate", "0"], "argument --intermediate: wants a whole number of at least 1"),
        (["--files", "0"], "argument --files: wants a whole number of at least 1"),
        (["--hidden", "100"], "--hidden 100 is not a multiple of --heads 8"),
        (["--hidden", "4"], "--hidden must be at least 8, got 4"),
        (["--heads", "6", "--hidden", "240"], "--heads 6 is not a multiple of --kv-heads 4"),
    ],
)
def test_bad_numbers_are_refused_naming_the_option(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    said: str,
) -> None:
    """Each refused with exit status 2, its option named, no traceback, nothing written."""
    monkeypatch.setenv("STUDIOTUI_HOME", str(tmp_path / "home"))
    target = tmp_path / "demo"
    try:
        code = main(["demo-model", str(target), *args])
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and said in err, err
    assert "Traceback" not in err
    assert not target.exists() and not any(tmp_path.glob(".*partial"))


@pytest.mark.parametrize(("arch", "least"), [("gemma3_text", 3), ("qwen3_next", 3), ("gpt_oss", 2)])
def test_a_family_with_a_layer_pattern_refuses_fewer_layers_than_it_needs(
    tmp_path: Path, arch: str, least: int
) -> None:
    """With fewer, mlx-lm's own model loaded and then failed every forward with an
    IndexError (or ValueError); at the least, mlx-lm generates from it."""
    spec = {"arch": arch, "hidden": 64, "heads": 4, "kv_heads": 2, "dtype": "float32"}
    with pytest.raises(DemoModelError, match=f"--arch {arch} needs at least {least} --layers"):
        DemoSpec(**spec, layers=least - 1)
    model, tokenizer = mlx_lm.load(
        str(write_demo_model(tmp_path / arch, DemoSpec(**spec, layers=least)))
    )
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=2)


def test_the_tour_s_demo_model_reads_and_a_noise_model_says_what_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's tour writes `demo-model DIR` and chats "Hello there": that model
    recites its passage (it answered "rlnlnlnl…" when noise was the default); `--noise`
    keeps random output, and the model's facts say so wherever it is placed."""
    from studiotui.core.model_facts import NOISE_NOTE, read_model
    from worker.shared.demo_model import PASSAGE

    monkeypatch.setenv("STUDIOTUI_HOME", str(tmp_path / "home"))
    assert main(["demo-model", str(tmp_path / "demo"), "--layers", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich folds long lines
    assert "recites a passage" in out
    # Issue 30 item 9: written outside the model folders, it is said where they are.
    home = tmp_path / "home"
    assert f"note: {tmp_path} is not a model folder (models are looked for in" in out
    assert f"{home / 'models'}" in out and "`a` on the Models pane" in out
    model, tokenizer = mlx_lm.load(str(tmp_path / "demo"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True
    )
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert answer and PASSAGE.startswith(answer.strip()), answer
    assert read_model(tmp_path / "demo").note == ""

    inside = tmp_path / "home" / "models" / "noise"
    assert main(["demo-model", str(inside), "--layers", "2", "--noise"]) == 0
    out = capsys.readouterr().out
    assert "writes noise" in out and "not a model folder" not in out
    assert read_model(inside).note == NOISE_NOTE
    with pytest.raises(SystemExit):  # one or the other
        main(["demo-model", str(tmp_path / "x"), "--noise", "--recite"])


def test_a_quantized_demo_is_named_as_the_models_pane_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """mlx-lm keeps a MoE's router at 8 bits: the command said "4-bit" where the Models
    pane and the preview said "mixed 4/8-bit"; both now read the config written."""
    from studiotui.core.model_facts import read_model

    monkeypatch.setenv("STUDIOTUI_HOME", str(tmp_path / "home"))
    target = tmp_path / "moe"
    args = ["demo-model", str(target), "--arch", "qwen3_moe", "--layers", "2", "--quantize", "4"]
    assert main(args) == 0
    said = " ".join(capsys.readouterr().out.split())
    pane = read_model(target).quantization
    assert pane == "mixed 4/8-bit" and f", {pane}," in said, said
