"""Tensor parallelism in the Gluon megakernel, N ranks on one Hopper GPU (launch/tp.SharedGPUGroup; marker `gpu`).

Each rank's persistent kernel runs on its share of the SMs and its own stream; its O_PROJ, DOWN_PROJ and LM_HEAD
partials go to every rank's inbox and signal every rank's peer counters, its REDUCEs wait for them at system scope
(device/peer.py), as across GPUs. tools/check.py's decode check against the fp32 reference of the whole model: every
launch poisoned and relaunched (bit for bit), the K/V rows each rank appended to its heads checked, and every rank's
logits bit-identical to rank 0's."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the megakernel needs a Hopper (sm_90) GPU")]


# (model, ranks, layers, context): every shape at a context of 1000 (several attention splits a rank), the 1B's two
# ranks also at 17 (one split, the ring's first partial slot)
CASES = [("llama-3.2-1b", 2, 4, 17), ("llama-3.2-1b", 2, 4, 1000), ("llama-3.2-1b", 4, 4, 1000),
         ("llama-3.1-8b", 2, 4, 1000), ("llama-3.1-8b", 4, 4, 1000), ("llama-3.1-8b", 8, 2, 1000),
         ("qwen3-8b", 2, 4, 1000), ("smollm2-135m", 3, 0, 1000), ("llama-3.1-70b", 8, 2, 1000)]


@pytest.mark.parametrize("model,ranks,layers,context", CASES)
def test_ranks_on_one_gpu_match_the_whole_models_reference(model, ranks, layers, context):
    from mimw.bench.config import preset_spec
    from mimw.megakernel.tools.check import check_decode

    r = check_decode(preset_spec(model, layers), context, steps=16, tp=ranks)
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.tp_disagreements == 0, f"ranks' logits differ: {r}"
    assert r.max_rel_err <= 2e-2, r
    assert r.argmax_agree_or_tie >= 0.99, r
    assert r.kv_rel_err <= max(1e-2, 2 * r.bf16_kv_rel_err), r


def test_replay_reruns_the_last_step_bit_for_bit():
    """``SharedGPUGroup.replay`` (tools.tp_check's timed step): every rank's CUDA graph reruns the last
    ``step_batch``'s step, the ranks in flight together, to the same logits bit for bit over poisoned scratch."""
    from mimw.bench.config import preset_spec
    from mimw.megakernel.launch.tp import SharedGPUGroup
    from mimw.megakernel.tools.check import random_cache
    from mimw.models.weights import random_weights

    spec = preset_spec("llama-3.2-1b", 2)
    w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
    cache, table = random_cache(spec, 1000, 8, 16, 1)
    group = SharedGPUGroup(w, cache, 2, max_pages_per_seq=len(table), context_hint=1000)
    want = group.step(1, 1000, table).clone()
    assert torch.isfinite(want).all()
    for _ in range(3):
        group.poison()
        group.replay()
        torch.cuda.synchronize()
        for d in group.decoders:
            assert torch.equal(d.scratch.logits, want)
