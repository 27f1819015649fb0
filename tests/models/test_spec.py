import pytest

from mimw.models.spec import PRESETS, Llama3RopeScaling, ModelSpec, SpecError, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    spec = PRESETS[name]
    assert ModelSpec.from_hf_config(spec.to_hf_config(), name=name) == spec


# Published totals (model cards / safetensors metadata); the Qwen3 cards publish non-embedding counts.
@pytest.mark.parametrize("name, total", [
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.2-3b", 3_212_749_824),
    ("llama-3.1-8b", 8_030_261_248),
    ("llama-3.1-70b", 70_553_706_496),
    ("smollm2-135m", 134_515_008),
])
def test_preset_param_counts(name, total):
    assert PRESETS[name].param_count() == total


@pytest.mark.parametrize("name, non_embedding_billions", [("qwen3-0.6b", 0.44), ("qwen3-1.7b", 1.4),
                                                          ("qwen3-8b", 6.95)])
def test_qwen3_non_embedding_counts(name, non_embedding_billions):
    s = PRESETS[name]
    emb = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    assert abs((s.param_count() - emb) / 1e9 - non_embedding_billions) < 0.01


def test_published_shapes():
    s = get_preset("smollm2-135m")
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (576, 30, 9, 3, 64)
    s = get_preset("qwen3-8b")
    assert (s.q_size, s.kv_size, s.group_size, s.qk_norm, s.attention_bias) == (4096, 1024, 4, True, False)
    assert get_preset("llama-3.1-8b").rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_transformers_v5_rope_parameters_are_read():
    cfg = get_preset("tiny-llama3").to_hf_config()
    rs = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = dict(rs, rope_theta=cfg.pop("rope_theta"))
    spec = ModelSpec.from_hf_config(cfg, name="tiny-llama3")
    assert spec == get_preset("tiny-llama3")


def _cfg(**changes):
    cfg = get_preset("tiny-llama").to_hf_config()
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    return cfg


@pytest.mark.parametrize("changes, field", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "architectures"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_kv_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
])
def test_bad_configs_raise_spec_error_naming_the_field(changes, field):
    with pytest.raises(SpecError, match=field):
        ModelSpec.from_hf_config(_cfg(**changes))


def test_unknown_preset():
    with pytest.raises(SpecError, match="known: .*tiny-llama"):
        get_preset("nope")


def test_llama_with_projection_biases_is_rejected_by_name():
    from mimw.models.spec import ModelSpec, SpecError, get_preset

    cfg = get_preset("tiny-llama").to_hf_config()
    cfg["attention_bias"] = True
    with pytest.raises(SpecError, match="attention_bias"):
        ModelSpec.from_hf_config(cfg)


def test_qwen3_30b_a3b_published_shape_and_counts():
    s = get_preset("qwen3-30b-a3b")
    assert (s.num_layers, s.hidden_size, s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (
        48, 2048, 128, 8, 768)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.qk_norm, s.moe_layers) == (32, 4, 128, True, tuple(range(48)))
    # the model card: 30.5B parameters, 29.9B non-embedding, 3.3B activated
    emb = s.vocab_size * s.hidden_size
    assert abs(s.param_count() / 1e9 - 30.5) < 0.05 and abs((s.param_count() - 2 * emb) / 1e9 - 29.9) < 0.05
    active = s.decode_weight_bytes(1, routed_experts=48 * 8) + emb  # a token's weights, the embedding table too
    assert abs(active / 1e9 - 3.3) < 0.1


def test_decode_weight_bytes_counts_only_the_routed_experts():
    s = get_preset("tiny-qwen3-moe")  # layers 0 and 2 MoE, layer 1 dense
    every = s.decode_weight_bytes()
    assert s.decode_weight_bytes(routed_experts=2 * s.num_experts) == every
    assert every - s.decode_weight_bytes(routed_experts=5) == (2 * s.num_experts - 5) * s.expert_param_count * 2
    with pytest.raises(ValueError, match="routed_experts"):
        s.decode_weight_bytes(routed_experts=2 * s.num_experts + 1)
    dense = get_preset("tiny-qwen3")
    assert dense.decode_weight_bytes() == dense.decode_weight_bytes(routed_experts=0)  # nothing to subtract


@pytest.mark.parametrize("changes, field", [
    (dict(num_experts_per_tok=17), "num_experts_per_tok"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(dense_layers=(2, 1)), "dense_layers"),
    (dict(dense_layers=(3,)), "dense_layers"),
    (dict(arch="qwen3"), "num_experts"),
    (dict(num_experts=0), "num_experts"),
])
def test_bad_moe_specs_raise_naming_the_field(changes, field):
    with pytest.raises(SpecError, match=field):
        get_preset("tiny-qwen3-moe").with_(**changes)
