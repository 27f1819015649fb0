import subprocess
import sys
import types
from pathlib import Path

import pytest

from mimw import cli


def _mimw(*args, timeout=300):
    exe = Path(sys.executable).parent / "mimw"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mimw.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands():
    r = _mimw("--help")
    assert r.returncode == 0
    for command in ("generate", "serve", "bench"):
        assert command in r.stdout


def test_generate_default_model_knows_paris():
    r = _mimw("generate", "--prompt", "The capital of France is", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is") and "Paris" in r.stdout
    assert "tok/s" in r.stderr and "Traceback" not in r.stderr


def test_generate_speculative_prints_the_same_text():
    args = ("generate", "--prompt", "Repeat exactly: one two three four five six seven eight.", "--chat",
            "--max-tokens", "24")
    plain = _mimw(*args)
    spec = _mimw(*args, "--speculative", "suffix", "--spec-tokens", "6")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "speculative suffix:" in spec.stderr


def test_generate_with_an_fp8_kv_cache():
    r = _mimw("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--kv-dtype", "fp8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "KV fp8" in r.stderr


@pytest.mark.parametrize("argv, match", [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--kv-dtype", "int4"], "invalid choice"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "positive integer"),
    (["generate", "--prompt", "x", "--device", "tpu"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_argparse_errors_exit_2(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["generate", "--prompt", "x", "--temperature", "-1", "--model", "tiny-llama"], "temperature"),
    (["generate", "--prompt", "x", "--top-p", "2", "--model", "tiny-llama"], "top_p"),
    (["generate", "--prompt", "x", "--model", "/no/such/dir"], "does not exist"),
    (["generate", "--prompt", "x", "--model", "tiny-llama"], "no tokenizer"),
    (["generate", "--prompt", "x", "--spec-tokens", "3"], "need --speculative"),
    (["generate", "--prompt", "x", "--speculative", "draft"], "--draft-model"),
])
def test_bad_values_give_one_line_error(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert ("\n" + err).count("\nmimw: error:") == 1 and match in err and "Traceback" not in err


def test_cuda_requested_without_cuda(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "--prompt", "x", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_lazy_commands_dispatch_to_their_module(monkeypatch, capsys):
    mod = types.ModuleType("mimw_fake_serve")
    mod.add_arguments = lambda p: p.add_argument("--port", type=int, default=1)
    mod.run = lambda args: args.port + 40
    monkeypatch.setitem(sys.modules, "mimw_fake_serve", mod)
    monkeypatch.setitem(cli._LAZY, "serve", ("mimw_fake_serve", "serve"))
    assert cli.main(["serve", "--port", "2"]) == 42


def test_missing_lazy_module_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(cli._LAZY, "bench", ("mimw.no_such_module", "bench"))
    assert cli.main(["bench"]) == 2
    assert "not available" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("mimw ")


@pytest.mark.parametrize("argv, match", [
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--prompt", "x", "--system", "be brief"], "--system needs --chat"),
])
def test_prompt_flags_are_checked_before_the_model_loads(monkeypatch, capsys, argv, match):
    from mimw.models import checkpoint

    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("mimw: error:") == 1 and match in err and "Traceback" not in err
