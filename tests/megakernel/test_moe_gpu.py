"""The megakernel's mixture-of-experts layers on a Hopper GPU against the fp32 reference decoder (marker `gpu`;
skipped without CUDA).

Each check (tools/check.check_decode) runs consecutive decode steps of one sequence on random weights over a random
paged cache, poisons the scratch (NaN, the routing table back to never written) before every launch, relaunches
every step and compares bit for bit, diffs the logits against the fp32 oracle, and reads the routing after every
step: the last MoE layer's table row must be exactly the top k of the router logits the kernel computed (with
their weights), and every MoE layer's entries must carry the step's tag and name the oracle's experts, or a
near-tie within the bf16 reference's own router error (a near-tie step is left out of the logits' comparison; at
most half the steps may be one: random routers put the k-th and (k+1)-th of many experts close); after every step
the references take the kernel's appended rows, checked first, so that a near-tie's rows do not move later steps.
A decode batch of the 30B-A3B's shape (``check_batch``: several sequences a launch, each distinct routed expert
streamed once) is checked through its logits and appended K/V.
The 30B-A3B runs at its real layer shape (2048 wide, 32 query heads on 4 KV heads, 128 experts of 768, 8 a token)
with 2 of its 48 layers (the fp32 oracle of all 48 would need ~122 GB; fewer layers also mean fewer routing
near-ties a step)."""
import pytest
import torch

from mimw.models.spec import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the megakernel needs a Hopper (sm_90) GPU")]


def _check(spec, context, steps):
    from mimw.megakernel.tools.check import check_decode

    r = check_decode(spec, context, steps=steps)
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.route_tags_ok, f"a routing entry without its step's tag: {r}"
    assert r.route_self_ok, f"the router finisher did not route its own logits as models.moe.top_k does: {r}"
    assert r.route_mismatches == 0 and r.route_exact > 0, r
    assert r.route_tie_steps <= steps // 2, r
    assert r.max_rel_err <= 2e-2, r
    assert r.kv_rel_err <= max(1e-2, 2 * r.bf16_kv_rel_err), r
    assert r.argmax_agree_or_tie >= 0.99, r
    return r


@pytest.mark.parametrize("context", [1, 17, 1000, 8191])
def test_tiny_moe_matches_reference(context):
    """16 experts, 4 a token, layer 1 dense beside the MoE layers 0 and 2 (16-row tiles, one column tile)."""
    _check(get_preset("tiny-qwen3-moe"), context, 32)


@pytest.mark.parametrize("context", [17, 8191])
def test_30b_a3b_shape_matches_reference(context):
    _check(get_preset("qwen3-30b-a3b").with_(num_layers=2), context, 16)


@pytest.mark.parametrize("batch", [3, 8])
def test_30b_a3b_shape_decode_batch_matches_reference(batch):
    """3 tokens: 24 slots, some unused whenever the tokens share experts; 8: the most an MoE step plans."""
    from mimw.megakernel.tools.check import check_batch

    r = check_batch(get_preset("qwen3-30b-a3b").with_(num_layers=2), batch, 1000, steps=6)
    # the routing's verdicts first (pytest cuts a long repr): a mismatch's needed bound against the bound
    assert r.ok(), (f"routings exact/tie/after-tie/mismatch {r.route_exact}/{r.route_ties}/{r.route_after_ties}/"
                    f"{r.route_mismatches}, bound "
                    f"{r.route_tie:.3g}, a mismatch needed {r.route_gap:.3g}; max rel err {r.max_rel_err:.3g}; {r}")


@pytest.mark.parametrize("model,layers", [("tiny-qwen3-moe", 0), ("qwen3-30b-a3b", 2)])
def test_every_routing_wait_is_traced(model, layers):
    """Traced (the default tuning otherwise), each SM records the routing wait (device/route_wait.py) of every MoE
    layer whose expert spans its queue holds, and nothing for a layer it streams no expert of (the tiny model's
    dense layer 1 included): a tagged stamp inside the step and a wait that began inside it; the summary has a wait
    for every MoE layer, and the step's logits are finite."""
    from mimw.megakernel import isa
    from mimw.megakernel.launch.decoder import MegakernelDecoder
    from mimw.megakernel.plan import Tuning
    from mimw.megakernel.tools.check import random_cache
    from mimw.megakernel.tools.trace import summarize
    from mimw.models.weights import random_weights

    spec = get_preset(model)
    spec = spec.with_(num_layers=layers) if layers else spec
    seed = int(torch.randint(0, 2**31, (1,)))
    w = random_weights(spec, seed, dtype=torch.bfloat16, device="cuda")
    context = 300
    cache, table = random_cache(spec, context, 1, 16, seed + 1)
    tok = int(torch.randint(spec.vocab_size, (1,)))
    dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), context_hint=context, tuning=Tuning(trace=True))
    assert dec.wait_trace.shape == (dec.num_sms, spec.num_layers, 2)
    for _ in range(2):  # the second launch's trace is kept (the first compiles and warms up)
        dec.scratch.poison()  # the routing table back to never written: every layer's loaders wait
        dec.trace.fill_(-1)
        dec.wait_trace.zero_()  # zero: an SM's "no wait on this layer"
        logits = dec.step(tok, context, table)[0].clone()
    torch.cuda.synchronize()
    stamps, waits = dec.trace.cpu(), dec.wait_trace.cpu()
    lens = dec.lens.cpu()
    starts = [int(stamps[s, i, 0]) for s in range(len(lens)) for i in range(int(lens[s]))]
    ends = [int(stamps[s, i, 3]) for s in range(len(lens)) for i in range(int(lens[s]))]
    t0, t1 = min(starts), max(ends)
    assert 0 < t0 < t1
    for s, q in enumerate(dec.program.queues):
        spans = {ins.layer for ins in q if ins.flags & isa.EXPERT_SPAN}
        for layer in range(spec.num_layers):
            tagged, ns = (int(x) for x in waits[s, layer])
            assert (tagged != 0) == (layer in spans), (s, layer, tagged)
            if layer in spans:  # the wait began inside the step (to the timer's microsecond granularity)
                assert t0 < tagged <= t1 and 0 <= ns <= tagged - t0 + 2000, (s, layer, tagged - t0, ns)
            else:
                assert ns == 0, (s, layer, ns)
    summary = summarize(dec.trace, dec.words, dec.lens, dec.wait_trace)
    assert sorted(summary["routing_waits"]["layers"]) == sorted(spec.moe_layers)
    assert torch.isfinite(logits).all()
