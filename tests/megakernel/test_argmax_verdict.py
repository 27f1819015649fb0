"""The GPU check's argmax verdicts (pure torch, runs on the CPU)."""
import pytest
import torch

from mimw.megakernel.tools.check import argmax_verdicts, step_error


def test_same_argmax_agrees_and_reports_the_error():
    expect = torch.tensor([1.0, 5.0, 2.0])
    same, gap, err = step_error(expect + torch.tensor([0.0, 0.1, 0.0]), expect)
    assert same and gap == 0.0 and abs(err - 0.02) < 1e-6


def test_a_different_argmax_reports_the_oracles_gap_to_the_pick():
    expect = torch.tensor([0.0, 10.0, 9.97])  # the oracle's best is 0.3% of max|logit| above the kernel's pick
    same, gap, err = step_error(torch.tensor([0.0, 9.98, 9.99]), expect)
    assert not same and abs(gap - 0.003) < 1e-6 and abs(err - 0.002) < 1e-6


def test_a_mismatch_within_the_tie_bound_is_a_near_tie_and_one_beyond_it_a_flip():
    steps = [(True, 0.0, 0.01), (False, 0.004, 0.01), (False, 0.012, 0.01), (True, 0.0, 0.02)]
    agree, near, flips = argmax_verdicts(steps, tie=0.01)
    assert (agree, near) == (2, 1)
    assert flips == [(1, 0.004, 0.01), (2, 0.012, 0.01)]  # every mismatch is listed, near-tie or not


def test_the_tie_bound_does_not_follow_the_kernels_own_error():
    # the kernel is 1% off and that flips a 1%-wide gap: its own error explains the flip, but with a tie bound
    # from a bf16 reference that erred by 0.25% (tie 0.5%) it is a flip
    expect = torch.tensor([0.0, 10.0, 9.9])
    step = step_error(torch.tensor([0.0, 9.9, 10.0]), expect)
    agree, near, _ = argmax_verdicts([step], tie=2 * 0.0025)
    assert (agree, near) == (0, 0) and abs(step[2] - 0.01) < 1e-6


def _routing(probs: list[float], k: int):
    from mimw.models.moe import Routing

    p = torch.tensor([probs])
    w, ids = torch.topk(p, k)
    return Routing(ids, w, p)


def test_a_routing_is_exact_a_near_tie_within_the_bound_or_a_mismatch():
    from mimw.megakernel.tools.check import _route_verdict

    r = _routing([0.40, 0.30, 0.151, 0.149, 0.0], 3)  # the oracle: experts 0, 1, 2; the 3rd and 4th 0.002 apart
    assert _route_verdict(r, {0, 1, 2}, 3, 0.0) == "exact"
    assert _route_verdict(r, {0, 1, 3}, 3, 0.004) == "tie"  # 3 for 2: within the bound of the boundary
    assert _route_verdict(r, {0, 1, 3}, 3, 0.001) == "mismatch"  # ... not within a tighter one
    assert _route_verdict(r, {0, 2, 3}, 3, 0.004) == "mismatch"  # dropping expert 1 (0.30) is no tie
    assert _route_verdict(r, {0, 1}, 3, 1.0) == "mismatch"  # too few experts


def test_route_gap_is_the_bound_at_which_a_routing_turns_into_a_near_tie():
    from mimw.megakernel.tools.check import _route_verdict, route_gap

    r = _routing([0.40, 0.30, 0.151, 0.149, 0.0], 3)
    assert route_gap(r, {0, 1, 2}, 3) == 0.0
    for got in ({0, 1, 3}, {0, 2, 3}):
        g = route_gap(r, got, 3)
        assert _route_verdict(r, got, 3, g + 1e-6) == "tie" and _route_verdict(r, got, 3, g - 1e-3) == "mismatch"
    assert route_gap(r, {0, 1, 3}, 3) == pytest.approx(0.002, abs=1e-6)
    assert route_gap(r, {0, 2, 3}, 3) == pytest.approx(0.30 - 0.149, abs=1e-6)  # expert 1 down to the 4th
    assert route_gap(r, {0, 1}, 3) == float("inf")


def test_a_batch_routing_is_judged_on_the_union_of_its_tokens_experts():
    """A decode batch's routing table names the step's distinct experts (the union over its tokens)."""
    from mimw.megakernel.tools.check import _route_verdict
    from mimw.models.moe import Routing

    p = torch.tensor([[0.40, 0.30, 0.151, 0.149, 0.0, 0.0, 0.0],    # token 0: experts 0, 1, 2 (2, 3 0.002 apart)
                      [0.0, 0.0, 0.0, 0.35, 0.33, 0.32, 0.0]])      # token 1: experts 3, 4, 5
    w, ids = torch.topk(p, 3)
    r = Routing(ids, w, p)
    assert _route_verdict(r, {0, 1, 2, 3, 4, 5}, 3, 0.0) == "exact"
    # token 0 took 3 for 2: 2 is then missing from the union (3 is token 1's anyway)
    assert _route_verdict(r, {0, 1, 3, 4, 5}, 3, 0.004) == "tie"
    assert _route_verdict(r, {0, 1, 3, 4, 5}, 3, 0.001) == "mismatch"
    # dropping expert 4 (token 1's 0.33, far above its 4th) is no tie
    assert _route_verdict(r, {0, 1, 2, 3, 5}, 3, 0.004) == "mismatch"
    # an expert no token comes near (6: probability 0 for both) in place of 2 is no tie
    assert _route_verdict(r, {0, 1, 3, 4, 5, 6}, 3, 0.004) == "mismatch"


def test_a_later_layer_of_a_near_tie_step_is_judged_after_the_tie_not_as_a_mismatch():
    """A step's first MoE layer takes a near-tie elsewhere than the oracle; its second layer's input then holds
    another expert's share, so any routing there is "after_tie". A step without an earlier tie still fails."""
    from mimw.megakernel.tools.check import RouteLog

    r = _routing([0.40, 0.30, 0.151, 0.149, 0.0], 3)
    far = {0, 3, 4}  # far from the oracle's 0, 1, 2: a mismatch on its own
    log = RouteLog(3, routes=[(0, r, {0, 1, 2}), (0, r, {0, 1, 2}),  # step 0: both layers exact
                              (1, r, {0, 1, 3}), (1, r, far),  # step 1: a tie, then anything
                              (2, r, far), (2, r, {0, 1, 3})], prob_err=0.002)  # step 2: a mismatch first
    verdicts, tied = log.judge()
    assert verdicts == ["exact", "exact", "tie", "after_tie", "mismatch", "tie"]
    assert tied == {1, 2}
    assert log.worst_gap(verdicts) == pytest.approx(0.30 - 0.149, abs=1e-6)  # step 2's first layer


def test_the_kernels_routing_table_is_read_with_its_steps_tag():
    from types import SimpleNamespace

    from mimw.megakernel import isa
    from mimw.megakernel.tools.check import _collect_routes
    from mimw.models.spec import get_preset

    spec = get_preset("tiny-qwen3-moe")  # layers 0 and 2 are MoE
    routed = torch.zeros(spec.num_layers, 4, dtype=torch.int32)
    for li in spec.moe_layers:
        routed[li] = torch.tensor([isa.route_entry(e, 6) for e in (1, 4, 9, 12)])
    dec = SimpleNamespace(state=SimpleNamespace(epoch=7), scratch=SimpleNamespace(routed=routed))
    out = []
    assert _collect_routes(dec, spec, 3, ["r0", "r2"], out)
    assert out == [(3, "r0", {1, 4, 9, 12}), (3, "r2", {1, 4, 9, 12})]
    routed[2, 1] = isa.route_entry(4, 5)  # the previous step's entry: stale
    assert not _collect_routes(dec, spec, 3, ["r0", "r2"], [])


def test_a_routing_table_is_checked_against_the_reference_finisher_on_the_kernels_own_logits():
    from types import SimpleNamespace

    from mimw.megakernel import isa
    from mimw.megakernel.ops.router import slots
    from mimw.megakernel.tools.check import own_routing_ok
    from mimw.models.moe import top_k
    from mimw.models.spec import get_preset

    spec = get_preset("tiny-qwen3-moe")  # 16 experts, 4 a token; layer 2 is the last MoE layer
    n_slots, m = 8, 2
    logits = torch.randn(m, 16, generator=torch.Generator().manual_seed(3))
    w, ids = top_k(logits, spec)
    experts, sw = slots(ids, w.to(torch.bfloat16).float(), n_slots)
    routed = torch.zeros(spec.num_layers, n_slots, dtype=torch.int32)
    routed[2] = torch.tensor([isa.route_entry(e, 9) for e in experts])
    scratch = SimpleNamespace(router_logits=logits, routed=routed, slot_w=sw.clone())
    dec = SimpleNamespace(scratch=scratch)
    assert own_routing_ok(dec, spec)
    j, t = [int(v) for v in torch.nonzero(sw)[0]]
    scratch.slot_w[j, t] *= 1.02  # two bf16 steps off
    assert not own_routing_ok(dec, spec)
    scratch.slot_w.copy_(sw)
    used = sum(e != isa.NO_EXPERT for e in experts)
    j, t = [int(v) for v in torch.nonzero(sw[:used] == 0)[0]]
    scratch.slot_w[j, t] = 0.05  # a weight for an expert (in use) the token did not choose
    assert not own_routing_ok(dec, spec)
    scratch.slot_w.copy_(sw)
    routed[2, 0] = isa.route_entry(experts[1], 9)  # a slot holding another expert
    assert not own_routing_ok(dec, spec)


def test_a_route_log_names_the_steps_routed_to_a_near_tie():
    from mimw.megakernel.tools.check import RouteLog

    r = _routing([0.40, 0.30, 0.151, 0.149, 0.0], 3)
    log = RouteLog(3, routes=[(0, r, {0, 1, 2}), (1, r, {0, 1, 3}), (2, r, {0, 2, 3})], prob_err=0.002)
    assert log.route_tie == 0.004
    assert log.judge() == (["exact", "tie", "mismatch"], {1})
