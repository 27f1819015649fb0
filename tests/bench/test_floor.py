"""The floor arithmetic: bytes a step must read, and the figures derived from a step time."""
import pytest

from mimw.bench.floor import achieved_tbps, floor_ms, step_bytes, tokens_per_s
from mimw.models.spec import get_preset


def test_step_bytes_is_weights_plus_kv_at_context():
    spec = get_preset("llama-3.2-1b")
    assert step_bytes(spec, 0) == spec.decode_weight_bytes()
    # 16 layers x 8 KV heads x 64 dims x (K and V) x 2 bytes = 32 KiB per cached token
    assert spec.kv_bytes_per_token() == 32768
    assert step_bytes(spec, 1024) == spec.decode_weight_bytes() + 1024 * 32768
    # the published shape: ~1.24 G parameters read per step (tied embedding counted once) -> ~2.47 GB in bf16
    assert 2.4e9 < step_bytes(spec, 0) < 2.55e9
    with pytest.raises(ValueError):
        step_bytes(spec, -1)


def test_floor_and_derived_figures():
    spec = get_preset("llama-3.1-8b")
    nbytes = step_bytes(spec, 8192)
    fl = floor_ms(nbytes, 4.5e12)
    assert fl == pytest.approx(nbytes / 4.5e12 * 1e3)
    assert 3.3 < floor_ms(step_bytes(spec, 0), 4.5e12) < 3.6          # GPU.md's 3.34 ms anchor
    assert achieved_tbps(nbytes, fl) == pytest.approx(4.5)            # running at the floor = read bandwidth
    assert achieved_tbps(nbytes, 2 * fl) == pytest.approx(2.25)
    assert tokens_per_s(0.5) == pytest.approx(2000.0)
    with pytest.raises(ValueError):
        floor_ms(nbytes, 0.0)


def test_moe_floor_counts_the_distinct_routed_experts_once():
    import torch

    from mimw.bench.floor import routed_experts
    from mimw.models.moe import Routing

    spec = get_preset("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="routed_experts"):
        step_bytes(spec, 1024)
    one = step_bytes(spec, 1024, routed_experts=48 * 8)  # batch 1: 8 distinct experts a layer
    expert = 3 * 2048 * 768 * 2
    assert one - step_bytes(spec, 1024, routed_experts=48 * 7) == 48 * expert
    # everything but the routed experts: attention, routers, norms, the LM head, one embedding row, the KV
    attn = 48 * (2048 * (4096 + 2 * 512) + 4096 * 2048 + 128 * 2048 + 2 * 2048 + 2 * 128)
    rest = (attn + 2048 + 151936 * 2048 + 2048) * 2 + 1024 * 48 * 2 * 512 * 2
    assert one == rest + 48 * 8 * expert
    assert 6.0e9 < one < 6.3e9 and one < spec.decode_weight_bytes() / 9  # 61 GB of weights in all
    # a step's routings: two tokens sharing expert 3 in the first MoE layer read it once
    r = [Routing(torch.tensor([[3, 1], [3, 5]]), torch.ones(2, 2)),
         Routing(torch.tensor([[0, 2], [2, 0]]), torch.ones(2, 2))]
    assert routed_experts(r) == 3 + 2
    dense = get_preset("llama-3.2-1b")  # the dense floor is unchanged, whatever is passed
    assert step_bytes(dense, 1024, routed_experts=5) == step_bytes(dense, 1024) == dense.decode_weight_bytes() + \
        1024 * dense.kv_bytes_per_token()
