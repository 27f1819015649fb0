"""An MoE step's check: one reference per near-tie routing (mimw.bench.routes), so that a backend whose router
resolves a near-tie the other way passes while a wrong expert or wrong numbers still fail."""
import pytest
import torch

from mimw.bench.check import compare_logits, compare_routes
from mimw.bench.fused import random_bench_weights
from mimw.bench.inputs import decode_inputs, reference_logits
from mimw.bench.peers import PeerContext
from mimw.bench.peers.torch_peers import torch_eager
from mimw.bench.routes import Route, choices, enumerate_routes, follow, step_routes, tie_gap
from mimw.bench.worker import Reference
from mimw.models.moe import Routing, top_k
from mimw.models.spec import get_preset

SPEC = get_preset("tiny-qwen3-moe")  # 16 experts, 4 a token; layers 0 and 2 MoE


def test_choices_are_the_top_k_and_its_near_ties_only():
    p = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.099, 0.05, 0.001])
    assert choices(p, [0, 1, 2, 3], tie=1e-4) == [(0, 1, 2, 3)]  # the 4th and 5th 1e-3 apart: no tie
    assert choices(p, [0, 1, 2, 3], tie=2e-3) == [(0, 1, 2, 3), (0, 1, 2, 4)]
    # the router picked expert 4 over an equal 3: its pick is "own", the other the near-tie
    q = p.clone()
    q[4] = q[3]
    assert choices(q, [0, 1, 2, 4], tie=0.0) == [(0, 1, 2, 4), (0, 1, 2, 3)]
    # a wide bound reaches further down, never dropping an expert far above the boundary
    assert choices(p, [0, 1, 2, 3], tie=0.06) == [(0, 1, 2, 3), (0, 1, 2, 4), (0, 1, 2, 5)]
    wide = choices(p, [0, 1, 2, 3], tie=0.11)  # experts 2 and 3 may go, 4, 5 and 6 come: 2 of 5
    assert all({0, 1} <= set(s) for s in wide) and len(wide) == 10 and (0, 1, 5, 6) in wide
    assert len(choices(p, [0, 1, 2, 3], tie=0.11, limit=4)) == 4


def test_follow_weights_a_chosen_set_as_top_k_weights_its_own():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    w, ids = top_k(logits, SPEC)
    r = Routing(ids, w.to(torch.bfloat16), torch.softmax(logits, -1, dtype=torch.float32))
    same = follow(r, ids, SPEC)
    assert torch.equal(same.weights, r.weights) and same.weights.dtype == torch.bfloat16
    other = follow(r, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), SPEC)
    assert torch.allclose(other.weights.float().sum(-1), torch.ones(2), atol=1e-2)
    assert torch.allclose(other.weights.float()[1], r.probs[1, 4:8] / r.probs[1, 4:8].sum(), atol=4e-3)


def test_enumeration_is_breadth_first_and_capped():
    """A fake step: layer 0 has a tie; taking it creates a tie at layer 2; the own routing has none there."""

    def run(forced):
        def r(p, own):
            return Routing(torch.tensor([own]), torch.full((1, 2), 0.5), torch.tensor([p]))
        tied0 = r([0.4, 0.25, 0.25, 0.1], [0, 1])
        l2 = r([0.4, 0.25, 0.25, 0.1], [0, 1]) if 0 in forced else r([0.7, 0.2, 0.1, 0.0], [0, 1])
        logits = torch.tensor([float(len(forced))])
        return logits, [(0, tied0), (2, l2)]

    routes, capped = enumerate_routes(run, tie=0.0)
    assert [len(r.deviations) for r in routes] == [0, 1, 2] and not capped
    assert [float(r.logits) for r in routes] == [0.0, 1.0, 2.0]  # each route's logits are its own run's
    assert routes[1].describe() == "layer 0 runs [2] for [1]"
    assert routes[2].describe() == "layer 0 runs [2] for [1]; layer 2 runs [2] for [1]"
    routes, capped = enumerate_routes(run, tie=0.0, limit=2)
    assert len(routes) == 2 and capped


def test_compare_routes_passes_on_any_route_and_fails_against_the_closest():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=g), torch.randn(100, generator=g)
    res, i = compare_routes(b + 1e-3 * a, [a, b])
    assert res.ok and i == 1
    res, i = compare_routes(a + b, [a, b])
    assert not res.ok and "rel_err" in res.detail


def _weights_with_a_tie():
    """bf16 tiny-MoE weights whose step (decode_inputs at context 5) has an exact tie at layer 0: the router's k-th
    and (k+1)-th experts share a router row. Returns (weights, inputs, the router's pick, the other)."""
    bw = random_bench_weights(SPEC, 0, torch.bfloat16, "cpu")
    inputs = decode_inputs(SPEC, 5, dtype=torch.bfloat16, device="cpu")
    routings = []
    reference_logits(bw.weights, inputs, routings)
    k = SPEC.num_experts_per_tok
    order = torch.argsort(routings[0].probs[0], descending=True).tolist()
    router = bw.weights.layers[0].router
    router[order[k]] = router[order[k - 1]]
    routings = []
    reference_logits(bw.weights, inputs, routings)
    picked = set(routings[0].ids[0].tolist())
    kth, out = (order[k - 1], order[k]) if order[k - 1] in picked else (order[k], order[k - 1])
    return bw, inputs, kth, out


@pytest.fixture(scope="module")
def tied():
    bw, inputs, kth, out = _weights_with_a_tie()
    return bw, inputs, kth, out, Reference(bw, inputs, torch.bfloat16)


def test_tie_gap_is_the_bound_at_which_choices_admit_a_set():
    p = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.099, 0.05, 0.001])
    own = [0, 1, 2, 3]
    assert tie_gap(p, own, [3, 2, 1, 0]) == 0.0  # any order of its own top k
    for chosen in ([0, 1, 2, 4], [0, 1, 2, 5], [0, 1, 5, 6], [1, 2, 3, 4]):
        g = tie_gap(p, own, chosen)
        assert tuple(sorted(chosen)) in choices(p, own, tie=g + 1e-6, limit=1000), (chosen, g)
        assert tuple(sorted(chosen)) not in choices(p, own, tie=g - 1e-6, limit=1000), (chosen, g)
    for bad in ([0, 1, 2], [0, 1, 2, 2], [0, 1, 2, 3, 4], [0, 1, 2, 7], [0, 1, 2, -1]):
        assert tie_gap(p, own, bad) == float("inf"), bad


def test_the_tie_is_a_route_and_moves_the_logits_past_a_plain_bound(tied):
    _, _, kth, out, ref = tied
    assert ref.route_tie > 0 and ref.noise < ref.rel_tol and not ref.routes_capped
    swapped = [r for r in ref.routes if r.deviations and r.deviations[0].layer == 0
               and out in r.deviations[0].chosen[0] and kth not in r.deviations[0].chosen[0]]
    assert swapped, [r.describe() for r in ref.routes]
    # the premise: the other expert's share moves the logits far past the bound a plain check would set
    assert compare_logits(swapped[0].logits, ref.logits, ref.rel_tol).rel_err > 3 * ref.rel_tol


def _eager_logits(bw, inputs) -> torch.Tensor:
    """An independent implementation of the step (the fused PyTorch peer: grouped GEMMs, its own top k)."""
    peer = torch_eager(PeerContext(bw, inputs, torch.device("cpu"), max_steps=2))
    peer.step()
    return peer.logits().float().reshape(-1)


def _prefer(bw, inputs, out: int, kth: int) -> None:
    """Nudge layer 0's router row of ``out`` (a copy of ``kth``'s) by 2^-5 so that the step routes to ``out``, not
    ``kth``: the sign that raises its logit is whichever makes the reference choose it."""
    router = bw.weights.layers[0].router
    for s in (1.0, -1.0):
        router[out] = (router[kth].float() * (1 + s * 2 ** -5)).to(router.dtype)
        routings = []
        reference_logits(bw.weights, inputs, routings)
        if out in routings[0].ids[0].tolist() and kth not in routings[0].ids[0].tolist():
            return
    raise AssertionError("no nudge of the router row moved the tie")


def test_a_backend_resolving_the_tie_the_other_way_passes_and_a_wrong_one_fails(tied):
    bw, inputs, kth, out, ref = tied
    router = bw.weights.layers[0].router
    keep = router.clone()
    try:
        assert ref.check(_eager_logits(bw, inputs))["ok"]  # the peer as is (its top k breaks the exact tie)
        # the peer with its router nudged to prefer the other expert: a faithful implementation whose rounding
        # went the other way at the tie
        _prefer(bw, inputs, out, kth)
        other = _eager_logits(bw, inputs)
        c = ref.check(other)
        assert c["ok"] and c["detail"].startswith("ok (routing near-tie") and c["routings"] >= 2, c
        assert f"layer 0 runs [{out}] for [{kth}]" in c["routing"], c
        assert not compare_logits(other, ref.logits, ref.rel_tol).ok  # what the plain check said of it
        # ... and the same backend one small numeric bug away: fails against every route
        bad = other + 0.05 * other.std() * torch.randn(other.shape, generator=torch.Generator().manual_seed(1))
        c = ref.check(bad)
        assert not c["ok"] and "near-tie routings" in c["detail"], c
    finally:
        router.copy_(keep)


def test_a_wrong_expert_or_wrong_numbers_fail(tied):
    bw, inputs, kth, out, ref = tied
    lw = bw.weights.layers[0]
    routings = []
    reference_logits(bw.weights, inputs, routings)
    top1 = int(routings[0].ids[0, 0])
    low = int(routings[0].probs[0].argmin())
    keep = [t.clone() for t in (lw.e_gate, lw.e_up, lw.e_down)]
    try:
        # a backend that loads the wrong expert's weights for the top expert (a kernel bug, not a near-tie)
        for t in (lw.e_gate, lw.e_up, lw.e_down):
            t[top1] = t[low]
        c = ref.check(_eager_logits(bw, inputs))
        assert not c["ok"], c
    finally:
        for t, k in zip((lw.e_gate, lw.e_up, lw.e_down), keep):
            t.copy_(k)
    good = _eager_logits(bw, inputs)
    assert ref.check(good)["ok"]
    assert not ref.check(good * 1.1)["ok"]
    assert not ref.check(torch.full_like(good, float("nan")))["ok"]


def test_a_dense_model_keeps_one_reference():
    spec = get_preset("tiny-qwen3")
    bw = random_bench_weights(spec, 0, torch.bfloat16, "cpu")
    ref = Reference(bw, decode_inputs(spec, 5, dtype=torch.bfloat16, device="cpu"), torch.bfloat16)
    assert ref.routes == [] and "routings" not in ref.check(ref.logits)


def test_step_routes_follow_the_chosen_experts():
    """A forced route runs exactly the experts it names (the routing the reference reports for it)."""
    bw, inputs, kth, out = _weights_with_a_tie()
    routes, _ = step_routes(bw.weights, inputs, tie=0.0)
    assert len(routes) == 2 and isinstance(routes[1], Route)
    d = routes[1].deviations[0]
    seen = []
    reference_logits(bw.weights, inputs, seen,
                     route=lambda layer, r: follow(r, torch.tensor(d.chosen), SPEC) if layer == d.layer else r)
    assert set(seen[0].ids[0].tolist()) == set(d.chosen[0]) and out in d.chosen[0] and kth not in d.chosen[0]


def _fake(logits_of):
    """A peer factory whose step returns ``logits_of(ctx)`` (a fake backend for the worker's check)."""
    from mimw.bench.peers import Peer

    def make(ctx):
        out = logits_of(ctx)
        return Peer(lambda: None, lambda: out, "fake")
    return make


def _wrong_router(ctx):
    """The reference with the first MoE layer's top expert replaced by its least probable one (a router bug)."""
    def route(layer, r):
        if layer != SPEC.moe_layers[0]:
            return r
        ids = r.ids.clone()
        ids[0, 0] = int(r.probs[0].argmin())
        return follow(r, ids, SPEC)
    return reference_logits(ctx.bw.weights, ctx.inputs, route=route)


def test_a_bf16_moe_run_checks_every_backend_against_its_routes(tmp_path, monkeypatch):
    """The worker end to end (bf16 on the CPU): the reference and the fused PyTorch peer pass, a wrong router and
    wrong numbers fail, and the report says so."""
    import json

    from mimw.bench import main as bench_main
    from mimw.bench import peers
    from mimw.bench.bandwidth import ReadBandwidth
    from mimw.bench.config import DecodeBenchConfig

    monkeypatch.setitem(peers.BACKENDS, "fake-wrong-expert", _fake(_wrong_router))
    monkeypatch.setitem(peers.BACKENDS, "fake-scaled",
                        _fake(lambda ctx: 1.1 * reference_logits(ctx.bw.weights, ctx.inputs)))
    names = ("mimw-reference", "torch-eager", "fake-wrong-expert", "fake-scaled")
    cfg = DecodeBenchConfig(models=("tiny-qwen3-moe",), contexts=(5,), backends=names, out_dir=str(tmp_path),
                            iters=2, warmup=1, budget_s=0.05, dtype="bfloat16", device="cpu", in_process=True)
    assert bench_main.run_decode(cfg, "Fake GPU", lambda: ReadBandwidth(1e11, 1 << 30, "fake", 9e10)) == 0
    [j] = tmp_path.glob("*-fake-gpu-tiny-qwen3-moe.json")
    rows = {r["backend"]: r for r in json.loads(j.read_text())["results"]}
    assert rows["mimw-reference"]["status"] == "ok" and rows["mimw-reference"]["check"]["rel_err"] == 0.0
    assert rows["torch-eager"]["status"] == "ok", rows["torch-eager"]["check"]
    for name in ("fake-wrong-expert", "fake-scaled"):
        assert rows[name]["status"] == "check-failed", rows[name]["check"]
    c = rows["torch-eager"]["check"]  # it reports its routing: judged on it, no enumeration
    assert c["routing_source"] == "own" and "routings" not in c
    assert c["route_tie"] > 0 and c["bf16_noise"] < c["rel_tol"]
    for name in ("fake-wrong-expert", "fake-scaled"):  # no routing reported: the enumeration judges them
        c = rows[name]["check"]
        assert c["routing_source"] == "enumerated" and c["routings"] >= 1, c
    md = j.with_suffix(".md").read_text()
    assert "fake-wrong-expert (✗ check)" in md and "(enumerated routings: no own routing)" in md
    assert "(own routing; " in md
