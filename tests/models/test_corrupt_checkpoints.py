"""Checkpoints mimw cannot compute correctly are refused: truncated or corrupt weight files (safetensors, GGUF) and
GGUF metadata that changes the math give a ``CheckpointError`` naming the file, and the CLI prints it as one line
with exit code 2."""
import json

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from mimw import cli
from mimw.models.checkpoint import load_model
from mimw.models.errors import CheckpointError
from mimw.models.gguf_file import load_gguf, open_gguf, save_gguf, spec_from_gguf
from mimw.models.safetensors_dir import INDEX_FILE, SINGLE_FILE, load_hf_dir, save_hf_dir
from mimw.models.spec import LinearRopeScaling, get_preset
from mimw.models.weights import random_weights


@pytest.fixture
def hf_dir(tmp_path):
    return save_hf_dir(random_weights(get_preset("tiny-llama"), seed=1), tmp_path / "ckpt")


@pytest.fixture
def gguf_path(tmp_path):
    return save_gguf(random_weights(get_preset("tiny-llama"), seed=1), tmp_path / "m.gguf")


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


@pytest.mark.parametrize("keep", [lambda n: n - 64, lambda n: n // 2, lambda n: 40, lambda n: 3, lambda n: 0])
def test_truncated_safetensors_names_the_file(hf_dir, keep):
    _truncate(hf_dir / SINGLE_FILE, keep)
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: not a readable safetensors file"):
        load_hf_dir(hf_dir, progress=False)


def test_corrupt_safetensors_header_names_the_file(hf_dir):
    f = hf_dir / SINGLE_FILE
    data = bytearray(f.read_bytes())
    data[8:16] = b"\x00garbage"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{SINGLE_FILE}: not a readable safetensors file"):
        load_hf_dir(hf_dir, progress=False)


def test_truncated_shard_names_the_shard(tmp_path):
    d = save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path / "ckpt", max_shard_bytes=20_000)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    _truncate(shard, lambda n: n // 2)
    with pytest.raises(CheckpointError, match=shard.name):
        load_hf_dir(d, progress=False)


def test_index_pointing_at_the_wrong_shard_names_both(tmp_path):
    d = save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path / "ckpt", max_shard_bytes=20_000)
    index = json.loads((d / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][name] = shards[1]
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{shards[1]}: does not hold tensor '{name}'"):
        load_hf_dir(d, progress=False)


def test_nan_weights_are_refused(hf_dir):
    f = hf_dir / SINGLE_FILE
    t = load_file(f)
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, f)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' holds 1 NaN"):
        load_hf_dir(hf_dir, progress=False)


@pytest.mark.parametrize("keep", [lambda n: n - 100, lambda n: n // 2, lambda n: 200, lambda n: 10, lambda n: 0])
def test_truncated_gguf_names_the_file(gguf_path, keep):
    _truncate(gguf_path, keep)
    with pytest.raises(CheckpointError, match=r"m\.gguf: not a readable GGUF file"):
        load_gguf(gguf_path, progress=False)


def test_nan_in_gguf_is_refused(tmp_path):
    w = random_weights(get_preset("tiny-llama"), seed=1)
    w.layers[0].w_down[0, 0] = float("inf")
    path = save_gguf(w, tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_down\.weight' holds 1 NaN/infinite"):
        load_gguf(path, progress=False)


def test_linear_rope_scaling_round_trips_through_gguf(tmp_path):
    w = random_weights(get_preset("tiny-llama").with_(rope_scaling=LinearRopeScaling(2.0)), seed=1)
    back = load_gguf(save_gguf(w, tmp_path / "m.gguf"), progress=False)
    assert back.spec.rope_scaling == LinearRopeScaling(2.0)


def _gguf_with(path, extra):
    """A tiny llama GGUF header with the required metadata plus ``extra`` {key after 'llama.': value}."""
    wr = gguf.GGUFWriter(path, "llama")
    wr.add_block_count(1)
    wr.add_context_length(64)
    wr.add_embedding_length(8)
    wr.add_feed_forward_length(16)
    wr.add_head_count(2)
    wr.add_layer_norm_rms_eps(1e-5)
    for k, v in extra.items():
        add = wr.add_bool if isinstance(v, bool) else wr.add_uint32 if isinstance(v, int) else wr.add_float32
        add(f"llama.{k}", v)
    wr.add_tensor("token_embd.weight", torch.zeros(16, 8).numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.mark.parametrize("extra, match", [
    ({"rope.dimension_count": 2}, "partial rotary"),
    ({"attention.key_length": 4, "attention.value_length": 8}, "value_length"),
    ({"attention.sliding_window": 16}, "sliding-window"),
    ({"expert_count": 8}, "expert_count"),
    ({"attention.layer_norm_epsilon": 1e-5}, "LayerNorm"),
    ({"attention.scale": 0.5}, "attention.scale"),
    ({"attn_logit_softcapping": 50.0}, "soft-capping"),
    ({"logit_scale": 0.25}, "logit_scale"),
    ({"attention.causal": False}, "non-causal"),
])
def test_gguf_metadata_that_changes_the_math_is_refused(tmp_path, extra, match):
    with pytest.raises(CheckpointError, match=match):
        spec_from_gguf(open_gguf(_gguf_with(tmp_path / "x.gguf", extra)))


@pytest.mark.parametrize("extra", [{}, {"rope.dimension_count": 4}, {"attention.sliding_window": 64},
                                   {"attention.causal": True}, {"logit_scale": 1.0}])
def test_neutral_gguf_metadata_is_accepted(tmp_path, extra):
    assert spec_from_gguf(open_gguf(_gguf_with(tmp_path / "x.gguf", extra))).head_dim == 4


def test_load_model_and_the_cli_report_a_truncated_file_in_one_line(gguf_path, hf_dir, capsys):
    _truncate(gguf_path, lambda n: n // 2)
    _truncate(hf_dir / SINGLE_FILE, lambda n: n // 2)
    for path in (gguf_path, hf_dir):
        with pytest.raises(CheckpointError, match=path.name):
            load_model(str(path), progress=False)
        assert cli.main(["generate", "--prompt", "x", "--model", str(path)]) == 2
        _assert_one_error_line(capsys.readouterr().err, "mimw: error:", path.name)


def test_serve_reports_a_refused_config_in_one_line(hf_dir, capsys):
    from mimw.server.main import main as serve_main

    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert serve_main(["--model", str(hf_dir), "--device", "cpu"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "mimw serve: error:", "config.json: hidden_act")


def _assert_one_error_line(err, prefix, needle):
    """The last stderr line is the one error line (progress lines may precede it); no traceback."""
    lines = err.strip().splitlines()
    assert lines[-1].startswith(prefix) and needle in lines[-1], err
    assert sum(line.startswith(prefix) for line in lines) == 1 and "Traceback" not in err
