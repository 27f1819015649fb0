"""The gpt-fast-style FusedDecoder (behind the torch peers) matches the reference decoder in fp32 on CPU."""
import pytest
import torch

from mimw.bench.fused import fuse, random_bench_weights
from mimw.bench.inputs import decode_inputs, reference_logits
from mimw.bench.peers.torch_decoder import FusedDecoder
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

TINY = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]


@pytest.mark.parametrize("name", TINY)
def test_fused_decoder_matches_reference(name):
    spec = get_preset(name)
    bw = fuse(random_weights(spec, seed=1))
    inputs = decode_inputs(spec, 29, seed=1, dtype=torch.float32, device="cpu")
    ref = reference_logits(bw.weights, inputs)
    m = FusedDecoder(bw, cache_len=40)
    m.load_prefix(inputs)
    with torch.no_grad():
        out = m(torch.tensor([inputs.token]), torch.tensor([inputs.context]))
        out2 = m(torch.tensor([inputs.token]), torch.tensor([inputs.context]))  # the step is repeatable
    assert out.shape == (1, spec.vocab_size)
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out2, out)


def test_fused_views_share_storage():
    spec = get_preset("tiny-qwen2")
    bw = random_bench_weights(spec, seed=0, dtype=torch.float32, device="cpu")
    lw = bw.weights.layers[1]
    q, kv = spec.q_size, spec.kv_size
    assert lw.wq.data_ptr() == bw.wqkv[1].data_ptr()
    assert lw.wv.data_ptr() == bw.wqkv[1][q + kv:].data_ptr() and lw.wv.is_contiguous()
    assert lw.w_up.data_ptr() == bw.w_gate_up[1][spec.intermediate_size:].data_ptr()
    assert lw.bk.data_ptr() == bw.bqkv[1][q:].data_ptr()
    assert set(lw.tensors()) == {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
                                 "bq", "bk", "bv"}
    shapes = {k: tuple(v.shape) for k, v in lw.tensors().items()}
    assert shapes == bw.weights.expected_shapes()
    assert bw.weights.lm_head is bw.weights.embed  # tied preset


def test_random_bench_weights_deterministic_and_scaled():
    spec = get_preset("tiny-llama")
    a = random_bench_weights(spec, seed=3, dtype=torch.float32, device="cpu")
    b = random_bench_weights(spec, seed=3, dtype=torch.float32, device="cpu")
    c = random_bench_weights(spec, seed=4, dtype=torch.float32, device="cpu")
    assert torch.equal(a.wqkv[0], b.wqkv[0]) and not torch.equal(a.wqkv[0], c.wqkv[0])
    assert not torch.equal(a.wqkv[0], a.wqkv[1])  # each tensor has its own stream
    std = float(a.w_gate_up[0].std())
    assert abs(std - spec.hidden_size ** -0.5) < 0.2 * spec.hidden_size ** -0.5
    assert abs(float(a.weights.layers[0].attn_norm.mean()) - 1.0) < 0.1


def test_load_prefix_rejects_short_cache():
    spec = get_preset("tiny-llama")
    bw = random_bench_weights(spec, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError):
        FusedDecoder(bw, cache_len=8).load_prefix(decode_inputs(spec, 8, dtype=torch.float32, device="cpu"))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_fused_decoder_traces_as_one_graph(name):
    """fullgraph=True as the compile peers use it (aot_eager: tracing + functionalization, no code generation); an
    MoE layer's routing stays on the device (no graph break, no host sync). The MoE model runs in bf16, the dtype
    the grouped GEMM takes on the GPU (its tracing checks it), and is compared with the same module run eagerly."""
    spec = get_preset(name)
    dtype = torch.bfloat16 if spec.is_moe else torch.float32
    bw = random_bench_weights(spec, seed=0, dtype=dtype, device="cpu")
    inputs = decode_inputs(spec, 9, dtype=dtype, device="cpu")
    m = FusedDecoder(bw, cache_len=16)
    m.load_prefix(inputs)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    tok, pos = torch.tensor([inputs.token]), torch.tensor([inputs.context])
    with torch.no_grad():
        out = compiled(tok, pos)
        eager = m(tok, pos)
    torch._dynamo.reset()
    if spec.is_moe:
        torch.testing.assert_close(out, eager)
    else:
        torch.testing.assert_close(out[0], reference_logits(bw.weights, inputs), rtol=1e-4, atol=1e-4)
