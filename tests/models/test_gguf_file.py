"""GGUF <-> ModelWeights on tiny random models: round trips, llama.cpp's Q/K layout as transformers reads it,
Llama 3 RoPE scaling recovered from rope_freqs, and clear errors."""
import math

import gguf
import pytest
import torch

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models import rope
from mimw.models.errors import CheckpointError
from mimw.models.gguf_file import _llama3_from_factors, load_gguf, open_gguf, save_gguf, spec_from_gguf
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import ModelWeights, random_weights

TINY = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"]


@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("matrix_type, tol", [("F32", 0.0), ("F16", 1e-3), ("Q8_0", 1e-2)])
def test_round_trip(tmp_path, preset, matrix_type, tol):
    w = random_weights(get_preset(preset), seed=5)
    back = load_gguf(save_gguf(w, tmp_path / "m.gguf", matrix_type), progress=False)
    assert back.spec == w.spec.with_(name="m")
    assert (back.lm_head is back.embed) == w.spec.tie_word_embeddings
    pairs = [(back.embed, w.embed), (back.final_norm, w.final_norm), (back.lm_head, w.lm_head)]
    for lb, lw in zip(back.layers, w.layers, strict=True):
        assert lb.tensors().keys() == lw.tensors().keys()
        pairs += [(lb.tensors()[k], lw.tensors()[k]) for k in lw.tensors()]
    for a, b in pairs:
        assert a.shape == b.shape and (a - b).abs().max() <= tol * b.abs().max()


def test_load_dtype_and_device(tmp_path):
    w = random_weights(get_preset("tiny-qwen2"), seed=0)
    back = load_gguf(save_gguf(w, tmp_path / "m.gguf"), dtype=torch.bfloat16, progress=False)
    assert back.dtype == torch.bfloat16 and back.layers[0].bk.dtype == torch.bfloat16
    assert torch.equal(back.layers[0].wk, w.layers[0].wk.to(torch.bfloat16))


# transformers' GGUF loader (reading the file as llama.cpp wrote it) must see the same model we do. Not for
# tiny-qwen3 (transformers ignores qwen3.attention.key_length, assuming head_dim 128) nor tiny-llama3
# (transformers ignores rope_freqs): both are transformers limitations, and their own tests cover our side.
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_transformers_reads_our_gguf_as_we_do(tmp_path, preset):
    from transformers import AutoModelForCausalLM

    w = random_weights(get_preset(preset), seed=7)
    save_gguf(w, tmp_path / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32,
                                              local_files_only=True).eval()
    ours = load_gguf(tmp_path / "m.gguf", progress=False)
    assert torch.equal(hf.state_dict()["model.layers.1.self_attn.q_proj.weight"], ours.layers[1].wq)
    assert torch.equal(hf.state_dict()["model.layers.1.self_attn.k_proj.weight"], ours.layers[1].wk)
    ids = torch.randint(0, w.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    cache = PagedKVCache(KVLayout.for_spec(w.spec, 8, 3, torch.float32))
    got = ReferenceDecoder(ours).forward(ids, [Segment((0, 1, 2), 0, 24)], cache)
    assert ((got - expected).abs().max() / expected.abs().max()) <= 1e-4


def _llama_cpp_rope_factors(spec):
    """llama.cpp convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), transcribed independently."""
    rs = spec.rope_scaling
    freqs = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    old, low, high = rs.original_max_position_embeddings, rs.low_freq_factor, rs.high_freq_factor
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(rs.factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / rs.factor + smooth))
    return torch.tensor(out, dtype=torch.float32).double()


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "tiny-llama3"])
def test_llama3_scaling_recovered_from_rope_freqs(preset):
    spec = get_preset(preset)
    rs = _llama3_from_factors(spec.with_(rope_scaling=None), _llama_cpp_rope_factors(spec), "x.gguf")
    assert rs.factor == spec.rope_scaling.factor
    assert torch.allclose(rope.inv_freq(spec.with_(rope_scaling=rs)), rope.inv_freq(spec), rtol=1e-5)
    if preset.startswith("llama"):
        assert rs == spec.rope_scaling  # the published (1, 4, 8192) come back exactly


def test_rope_freqs_that_are_not_llama3_are_an_error():
    spec = get_preset("tiny-llama")
    with pytest.raises(CheckpointError, match="rope_freqs.weight"):
        _llama3_from_factors(spec, torch.linspace(1.0, 3.0, spec.head_dim // 2, dtype=torch.float64), "x.gguf")


def _reshaped(w, **spec_changes):
    return ModelWeights(w.spec.with_(**spec_changes), w.embed, w.layers, w.final_norm, w.lm_head)


def test_missing_tensor_is_named(tmp_path):
    w = random_weights(get_preset("tiny-llama"))
    save_gguf(_reshaped(w, num_layers=3), tmp_path / "m.gguf")  # metadata says 3 blocks, file holds 2
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.2\.attn_norm\.weight'"):
        load_gguf(tmp_path / "m.gguf", progress=False)


def test_shape_mismatch_is_named(tmp_path):
    w = random_weights(get_preset("tiny-llama"))
    save_gguf(_reshaped(w, intermediate_size=96), tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_gate\.weight' has shape \[128, 64\], expected \[96, 64\]"):
        load_gguf(tmp_path / "m.gguf", progress=False)


def _minimal_gguf(path, arch, **fields):
    wr = gguf.GGUFWriter(path, arch)
    for k, v in fields.items():
        getattr(wr, f"add_{k}")(v)
    wr.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def test_unsupported_architecture(tmp_path):
    with pytest.raises(CheckpointError, match="general.architecture: unsupported 'gemma2'"):
        spec_from_gguf(open_gguf(_minimal_gguf(tmp_path / "g.gguf", "gemma2")))


def test_missing_metadata_field_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="llama.embedding_length"):
        spec_from_gguf(open_gguf(_minimal_gguf(tmp_path / "l.gguf", "llama", block_count=2)))


def test_unsupported_rope_scaling_type(tmp_path):
    f = _minimal_gguf(tmp_path / "l.gguf", "llama", block_count=1, context_length=64, embedding_length=4,
                      feed_forward_length=8, head_count=2, layer_norm_rms_eps=1e-5,
                      rope_scaling_type=gguf.RopeScalingType.YARN)
    with pytest.raises(CheckpointError, match="rope.scaling.type: unsupported 'yarn'"):
        spec_from_gguf(open_gguf(f))


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        open_gguf(tmp_path / "x.gguf")
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        open_gguf(tmp_path / "missing.gguf")


def test_per_layer_metadata_is_an_error(tmp_path):
    f = _minimal_gguf(tmp_path / "l.gguf", "llama", block_count=2, context_length=64, embedding_length=4,
                      feed_forward_length=8, head_count=[2, 4], layer_norm_rms_eps=1e-5)
    with pytest.raises(CheckpointError, match="llama.attention.head_count: per-layer values"):
        spec_from_gguf(open_gguf(f))


# --- Qwen3-MoE (qwen3moe: every layer MoE, top-k always renormalised, as llama.cpp runs it) -------------------
MOE = get_preset("tiny-qwen3-moe").with_(dense_layers=())


@pytest.mark.parametrize("matrix_type, tol", [("F32", 0.0), ("Q8_0", 1e-2)])
def test_qwen3_moe_round_trip(tmp_path, matrix_type, tol):
    w = random_weights(MOE, seed=5)
    path = save_gguf(w, tmp_path / "m.gguf", matrix_type)
    names = {t.name for t in open_gguf(path).tensors}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight"} <= names
    assert not any("ffn_gate.weight" in n for n in names)
    back = load_gguf(path, progress=False)
    assert back.spec == w.spec.with_(name="m")
    for lb, lw in zip(back.layers, w.layers, strict=True):
        assert lb.tensors().keys() == lw.tensors().keys()
        for k, b in lw.tensors().items():
            assert lb.tensors()[k].shape == b.shape and (lb.tensors()[k] - b).abs().max() <= tol * b.abs().max()


def test_transformers_reads_our_qwen3_moe_gguf_as_we_do(tmp_path):
    """An independent reader of the stacked expert tensors. transformers' GGUF mapping has no
    expert_feed_forward_length (it takes Qwen3MoeConfig's default 768), so the experts here are 768 wide."""
    from transformers import AutoModelForCausalLM

    w = random_weights(MOE.with_(moe_intermediate_size=768, num_layers=2), seed=7)
    save_gguf(w, tmp_path / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32,
                                              local_files_only=True).eval()
    ours = load_gguf(tmp_path / "m.gguf", progress=False)
    assert hf.config.norm_topk_prob and hf.config.num_experts == ours.spec.num_experts
    ids = torch.randint(0, w.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    cache = PagedKVCache(KVLayout.for_spec(w.spec, 8, 3, torch.float32))
    got = ReferenceDecoder(ours).forward(ids, [Segment((0, 1, 2), 0, 24)], cache)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-4


def _moe_gguf(tmp_path, **fields):
    """Metadata of a qwen3moe file (MOE's shapes, one embedding tensor) plus ``fields`` (GGUFWriter.add_*)."""
    base = dict(block_count=3, context_length=512, embedding_length=64, feed_forward_length=128, head_count=8,
                head_count_kv=2, key_length=32, layer_norm_rms_eps=1e-6, rope_freq_base=1e6, expert_count=16,
                expert_used_count=4, eos_token_id=2)
    return _minimal_gguf(tmp_path / "m.gguf", "qwen3moe", **{**base, **fields})


@pytest.mark.parametrize("fields, key", [
    ({"expert_shared_count": 1}, "expert_shared_count"),
    ({"expert_weights_scale": 2.5}, "expert_weights_scale"),
    ({"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}, "expert_gating_func"),
    ({"expert_weights_norm": False}, "expert_weights_norm"),
    ({"expert_used_count": 0}, "expert_used_count"),
])
def test_qwen3_moe_metadata_mimw_cannot_compute_is_refused(tmp_path, fields, key):
    with pytest.raises(CheckpointError, match=f"qwen3moe.{key}"):
        spec_from_gguf(open_gguf(_moe_gguf(tmp_path, **fields)))


def test_qwen3_moe_neutral_metadata_is_accepted_and_the_expert_width_defaults_as_in_llama_cpp(tmp_path):
    spec = spec_from_gguf(open_gguf(_moe_gguf(tmp_path, expert_weights_norm=True, expert_shared_count=0,
                                              expert_gating_func=gguf.ExpertGatingFuncType.SOFTMAX)))
    # no expert_feed_forward_length: llama.cpp takes feed_forward_length / expert_used_count
    assert spec.with_(name=MOE.name, vocab_size=MOE.vocab_size, tie_word_embeddings=False) == MOE
    spec = spec_from_gguf(open_gguf(_moe_gguf(tmp_path, expert_feed_forward_length=48)))
    assert spec.moe_intermediate_size == 48 and spec.norm_topk_prob


def test_qwen2moe_is_refused_naming_its_shared_experts(tmp_path):
    with pytest.raises(CheckpointError, match="qwen2moe.*shared experts"):
        spec_from_gguf(open_gguf(_minimal_gguf(tmp_path / "q.gguf", "qwen2moe", block_count=1)))


def test_an_moe_spec_without_a_gguf_form_is_refused(tmp_path):
    for spec in (get_preset("tiny-qwen3-moe"), MOE.with_(norm_topk_prob=False)):
        with pytest.raises(ValueError, match="no GGUF form"):
            save_gguf(random_weights(spec), tmp_path / "x.gguf")
