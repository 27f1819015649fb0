"""The reference decoder against Hugging Face transformers on random tiny checkpoints (fp32).

Each checkpoint is written by transformers' ``save_pretrained`` and read back through mimw's loader; the
reference then runs a prefill and >= 16 single-token decode steps over the paged cache, and every step's logits
must match transformers' logits for the same positions (max error relative to the largest |logit| <= 1e-4).
Qwen3-MoE checkpoints (with and without top-k renormalisation, with dense layers, one expert per token) also
generate greedily in both, token for token."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.safetensors_dir import load_hf_dir
from mimw.models.spec import LinearRopeScaling, get_preset

MOE = get_preset("tiny-qwen3-moe")


def random_hf_model(spec, seed=0):
    """A transformers model for ``spec`` with every parameter random (norms ~ 1, biases nonzero)."""
    cfg = spec.to_hf_config()
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("preset, prefill, decode", [
    ("tiny-llama", 11, 16),
    ("tiny-llama3", 20, 24),  # positions up to 43, past original_max_position_embeddings=32
    ("tiny-qwen2", 11, 16),
    ("tiny-qwen3", 11, 16),
])
def test_reference_matches_transformers(tmp_path, preset, prefill, decode):
    _check_against_transformers(tmp_path, get_preset(preset), prefill, decode)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    _check_against_transformers(tmp_path, get_preset("tiny-llama").with_(rope_scaling=LinearRopeScaling(4.0)), 11, 16)


@pytest.mark.parametrize("spec", [
    MOE,  # renormalised top-4 of 16 experts, layer 1 dense
    MOE.with_(norm_topk_prob=False, dense_layers=()),  # the raw softmax probabilities of the chosen experts
    MOE.with_(num_experts_per_tok=1, num_experts=8, dense_layers=(0, 2)),
], ids=["norm-dense1", "no-norm", "top1"])
def test_qwen3_moe_matches_transformers(tmp_path, spec):
    model, weights, dec = _check_against_transformers(tmp_path, spec, 11, 16)
    assert [i for i, lw in enumerate(weights.layers) if lw.router is None] == list(spec.dense_layers)
    prompt = torch.randint(0, spec.vocab_size, (7,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 7:]
    cache = PagedKVCache(KVLayout.for_spec(spec, 8, 4, torch.float32))
    table, got, ids = tuple(range(4)), [], prompt
    for _ in range(12):
        pos = 0 if not got else 7 + len(got) - 1
        logits = dec.forward(ids, [Segment(table, pos, len(ids))], cache, last_only=True)
        got.append(int(logits[-1].argmax()))
        ids = torch.tensor(got[-1:])
    assert got == want.tolist()


def _check_against_transformers(tmp_path, spec, prefill, decode):
    model = random_hf_model(spec)
    model.save_pretrained(tmp_path)
    weights = load_hf_dir(tmp_path, progress=False)
    assert weights.spec.rope_scaling == spec.rope_scaling and weights.spec.arch == spec.arch

    n = prefill + decode
    ids = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids[None]).logits[0].float()  # [n, V]

    page = 8
    cache = PagedKVCache(KVLayout.for_spec(spec, page, -(-n // page) + 1, torch.float32))
    table = tuple(reversed(range(cache.layout.num_pages)))  # non-identity page order
    dec = ReferenceDecoder(weights)
    got = dec.forward(ids[:prefill], [Segment(table, 0, prefill)], cache)
    assert rel_err(got, expected[:prefill]) <= 1e-4
    for p in range(prefill, n):
        step = dec.forward(ids[p:p + 1], [Segment(table, p, 1)], cache)
        assert rel_err(step[0], expected[p]) <= 1e-4, f"decode step at position {p}"
    return model, weights, dec
