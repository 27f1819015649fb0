import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimw.models.errors import CheckpointError
from mimw.models.safetensors_dir import INDEX_FILE, SINGLE_FILE, load_hf_dir, save_hf_dir
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights


def assert_same(a, b):
    assert a.spec == b.spec.with_(name=a.spec.name)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.final_norm, b.final_norm)
    for la, lb in zip(a.layers, b.layers, strict=True):
        ta, tb = la.tensors(), lb.tensors()
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("shard", [None, 20_000])
def test_round_trip_single_and_sharded(tmp_path, preset, shard):
    w = random_weights(get_preset(preset), seed=3)
    save_hf_dir(w, tmp_path, max_shard_bytes=shard)
    if shard:
        assert (tmp_path / INDEX_FILE).is_file() and not (tmp_path / SINGLE_FILE).exists()
        assert len(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())) > 1
    back = load_hf_dir(tmp_path, progress=False)
    assert_same(back, w)
    assert (back.lm_head is back.embed) == w.spec.tie_word_embeddings


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float32])
def test_dtypes(tmp_path, src, dst):
    w = random_weights(get_preset("tiny-qwen2"), seed=0, dtype=src)
    save_hf_dir(w, tmp_path)
    back = load_hf_dir(tmp_path, dtype=dst, progress=False)
    assert back.dtype == dst and back.layers[0].bq.dtype == dst and back.final_norm.dtype == dst
    assert torch.equal(back.layers[1].wq, w.layers[1].wq.to(dst))


def _edit(tmp_path, fn):
    f = tmp_path / SINGLE_FILE
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_missing_tensor_is_named(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-qwen3")), tmp_path)
    _edit(tmp_path, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.self_attn\.k_norm\.weight'"):
        load_hf_dir(tmp_path, progress=False)


def test_shape_mismatch_is_named(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path)
    _edit(tmp_path, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 128)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[64, 128\], "
                                              r"expected \[128, 64\]"):
        load_hf_dir(tmp_path, progress=False)


def test_untied_checkpoint_needs_lm_head(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path)
    _edit(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_hf_dir(tmp_path, progress=False)


def test_unexpected_tensor_is_an_error(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path)
    _edit(tmp_path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        load_hf_dir(tmp_path, progress=False)


def test_quantized_dtype_is_an_error(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path)
    _edit(tmp_path, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int8"):
        load_hf_dir(tmp_path, progress=False)


def test_unsupported_architecture_names_it(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*MistralForCausalLM"):
        load_hf_dir(tmp_path, progress=False)


def test_missing_config_field_names_it(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_hf_dir(tmp_path, progress=False)


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_dir(tmp_path, progress=False)
    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny-llama").to_hf_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no model.safetensors.*pytorch_model.bin"):
        load_hf_dir(tmp_path, progress=False)


def test_index_listing_a_missing_shard(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-llama")), tmp_path, max_shard_bytes=20_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name}"):
        load_hf_dir(tmp_path, progress=False)


def test_directory_holding_only_a_gguf_points_at_the_file(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pass the .gguf file itself"):
        load_hf_dir(tmp_path, progress=False)


def test_moe_experts_are_one_tensor_per_expert_as_the_hub_holds_them(tmp_path):
    w = random_weights(get_preset("tiny-qwen3-moe"), seed=1)
    save_hf_dir(w, tmp_path)
    t = load_file(tmp_path / SINGLE_FILE)
    assert torch.equal(t["model.layers.2.mlp.experts.5.down_proj.weight"], w.layers[2].e_down[5])
    assert torch.equal(t["model.layers.0.mlp.gate.weight"], w.layers[0].router)
    assert "model.layers.1.mlp.gate_proj.weight" in t and "model.layers.1.mlp.gate.weight" not in t  # dense layer 1
    assert not any(k.startswith("model.layers.0.mlp.gate_proj") for k in t)


def test_a_missing_expert_is_named(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-qwen3-moe")), tmp_path)
    _edit(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.15.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.15\.up_proj\.weight'"):
        load_hf_dir(tmp_path, progress=False)


def test_an_expert_past_num_experts_is_unexpected(tmp_path):
    save_hf_dir(random_weights(get_preset("tiny-qwen3-moe")), tmp_path)
    _edit(tmp_path, lambda t: t.update({"model.layers.0.mlp.experts.16.up_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.16\."):
        load_hf_dir(tmp_path, progress=False)
