"""config.json -> ModelSpec field by field: what transformers computes is what mimw reads, and every field that
changes the math and that mimw does not compute is refused by name."""
import pytest
import torch
from transformers import AutoConfig

from mimw.models import rope
from mimw.models.spec import LinearRopeScaling, ModelSpec, SpecError, get_preset


def _cfg(preset="tiny-llama", drop=(), **changes):
    cfg = get_preset(preset).to_hf_config()
    for k in drop:
        cfg.pop(k)
    cfg.update(changes)
    return cfg


def _hf(cfg):
    cfg = dict(cfg)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _hf_theta(hf):
    rp = getattr(hf, "rope_parameters", None) or {}
    return rp.get("rope_theta", getattr(hf, "rope_theta", None))


# Hand-written configs with fields left out: the absent fields must mean what they mean to transformers.
@pytest.mark.parametrize("preset, drop", [
    ("tiny-llama", ("head_dim", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                    "tie_word_embeddings")),
    ("tiny-qwen2", ("head_dim", "max_position_embeddings", "rope_theta", "tie_word_embeddings")),
    ("tiny-qwen2", ("num_key_value_heads",)),
    ("tiny-qwen3", ("head_dim", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")),
])
def test_absent_fields_take_transformers_defaults(preset, drop):
    cfg = _cfg(preset, drop)
    if "num_key_value_heads" in drop:
        cfg["num_attention_heads"] = 32  # transformers' Qwen default of 32 KV heads must divide the heads
    spec, hf = ModelSpec.from_hf_config(cfg), _hf(cfg)
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert spec.head_dim == hf_head_dim
    assert spec.num_kv_heads == hf.num_key_value_heads
    assert spec.max_position_embeddings == hf.max_position_embeddings
    assert spec.rms_norm_eps == hf.rms_norm_eps
    assert spec.rope_theta == _hf_theta(hf)
    assert spec.tie_word_embeddings == hf.tie_word_embeddings


def test_qwen3_head_dim_defaults_to_128_not_hidden_over_heads():
    spec = ModelSpec.from_hf_config(_cfg("tiny-qwen3", drop=("head_dim",)))
    assert spec.head_dim == 128 != spec.hidden_size // spec.num_heads


@pytest.mark.parametrize("rope_field", [
    {"rope_scaling": {"type": "linear", "factor": 2.5}},  # transformers 4 spelling
    {"rope_scaling": {"rope_type": "linear", "factor": 2.5}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}},  # transformers 5
])
def test_linear_rope_scaling_is_read_in_every_spelling(rope_field):
    spec = ModelSpec.from_hf_config(_cfg(**rope_field))
    assert spec.rope_scaling == LinearRopeScaling(2.5)
    plain = rope.inv_freq(spec.with_(rope_scaling=None))
    assert torch.equal(rope.inv_freq(spec), plain / 2.5)
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


@pytest.mark.parametrize("changes", [
    {"hidden_act": "swish"},
    {"pretraining_tp": 4},  # transformers' modeling ignores it: the same math
    {"attention_dropout": 0.1},
    {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},
    {"rope_scaling": {"rope_type": "default"}},
    {"partial_rotary_factor": 1.0},
])
def test_fields_without_effect_on_the_math_are_accepted(changes):
    assert ModelSpec.from_hf_config(_cfg("tiny-qwen2", **changes)) == ModelSpec.from_hf_config(_cfg("tiny-qwen2"))


def test_a_sliding_window_as_long_as_the_context_is_accepted():
    cfg = _cfg("tiny-qwen3", use_sliding_window=True, sliding_window=512, max_window_layers=0)
    assert ModelSpec.from_hf_config(cfg).max_position_embeddings == 512


@pytest.mark.parametrize("preset, changes, field", [
    ("tiny-llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("tiny-qwen2", {"hidden_act": "relu"}, "hidden_act"),
    ("tiny-llama", {"attention_bias": True}, "attention_bias"),
    ("tiny-qwen3", {"attention_bias": True}, "attention_bias"),
    ("tiny-llama", {"mlp_bias": True}, "mlp_bias"),
    ("tiny-llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ("tiny-qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_type"),
    ("tiny-llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),
    ("tiny-llama", {"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ("tiny-llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("tiny-llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "use_sliding_window"),
    ("tiny-qwen3", {"use_sliding_window": True, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "use_sliding_window"),
    ("tiny-qwen3", {"layer_types": ["full_attention", "linear_attention", "full_attention"]}, "layer_types"),
    ("tiny-llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ("tiny-llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
])
def test_fields_that_change_the_math_are_refused_by_name(preset, changes, field):
    with pytest.raises(SpecError, match=field):
        ModelSpec.from_hf_config(_cfg(preset, **changes))


def test_sliding_window_layers_follow_max_window_layers():
    """transformers slides only layers >= max_window_layers: past the last layer, nothing slides."""
    cfg = _cfg("tiny-qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert ModelSpec.from_hf_config(cfg).arch == "qwen2"
    hf = _hf(cfg)
    assert "sliding_attention" not in hf.layer_types


# --- Qwen3-MoE ---------------------------------------------------------------------------------------------

def _hf_dense_layers(cfg):
    """The layers transformers builds with a dense MLP (a tiny model from the config, inspected)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    model = AutoModelForCausalLM.from_config(_hf(cfg))
    return tuple(i for i, layer in enumerate(model.model.layers) if not isinstance(layer.mlp, Qwen3MoeSparseMoeBlock))


def test_qwen3_moe_absent_fields_take_transformers_defaults():
    cfg = _cfg("tiny-qwen3-moe", drop=("head_dim", "num_key_value_heads", "norm_topk_prob", "decoder_sparse_step",
                                       "mlp_only_layers", "max_position_embeddings"))
    spec, hf = ModelSpec.from_hf_config(cfg), _hf(cfg)
    assert spec.head_dim == hf.hidden_size // hf.num_attention_heads  # no Qwen3-style default of 128
    assert spec.num_kv_heads == hf.num_key_value_heads == 4
    assert spec.norm_topk_prob is hf.norm_topk_prob is False
    assert spec.max_position_embeddings == hf.max_position_embeddings
    assert spec.dense_layers == () == _hf_dense_layers(cfg)
    bare = _cfg("tiny-qwen3-moe", drop=("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                        "intermediate_size"))
    spec, hf = ModelSpec.from_hf_config(bare), _hf(bare)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.intermediate_size) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.intermediate_size) == (128, 8, 768, 6144)


@pytest.mark.parametrize("step, only", [(1, [1]), (2, []), (3, [0]), (1, [0, 2]), (5, [])])
def test_qwen3_moe_dense_layers_follow_transformers(step, only):
    cfg = _cfg("tiny-qwen3-moe", decoder_sparse_step=step, mlp_only_layers=only, num_hidden_layers=4)
    assert ModelSpec.from_hf_config(cfg).dense_layers == _hf_dense_layers(cfg)


def test_qwen3_moe_reads_num_local_experts_as_transformers_5_saves_it():
    cfg = _cfg("tiny-qwen3-moe", drop=("num_experts",), num_local_experts=12)
    assert ModelSpec.from_hf_config(cfg).num_experts == 12 == _hf(cfg).num_experts


@pytest.mark.parametrize("changes, field", [
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "Qwen2MoeForCausalLM.*shared experts"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM"),
    ({"architectures": ["MixtralForCausalLM"]}, "architectures"),
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [1, "x"]}, "mlp_only_layers"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),  # every layer slides
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_qwen3_moe_fields_mimw_cannot_compute_are_refused_by_name(changes, field):
    with pytest.raises(SpecError, match=field):
        ModelSpec.from_hf_config(_cfg("tiny-qwen3-moe", **changes))


@pytest.mark.parametrize("changes", [{"output_router_logits": True}, {"router_aux_loss_coef": 0.5},
                                     {"shared_expert_intermediate_size": 0}])
def test_qwen3_moe_training_fields_are_accepted(changes):
    assert ModelSpec.from_hf_config(_cfg("tiny-qwen3-moe", **changes)) == \
        ModelSpec.from_hf_config(_cfg("tiny-qwen3-moe"))
