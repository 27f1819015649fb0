"""The own-routing check of an MoE step (mimw.bench.own_route): a backend that reports its routing is judged against
the reference forced onto it, once each layer's experts are found to be the router's top k or a near-tie of it."""
import pytest
import torch

from mimw.bench.check import compare_logits
from mimw.bench.fused import random_bench_weights
from mimw.bench.inputs import decode_inputs, reference_logits
from mimw.bench.own_route import own_route_check
from mimw.bench.peers import PeerContext
from mimw.bench.peers.torch_decoder import FusedDecoder
from mimw.bench.peers.torch_peers import torch_eager
from mimw.bench.routes import follow
from mimw.bench.worker import Reference
from mimw.megakernel import isa
from mimw.megakernel.bench_backend import routing_entries
from mimw.models.spec import get_preset

SPEC = get_preset("tiny-qwen3-moe")  # 16 experts, 4 a token; layers 0 and 2 MoE
K = SPEC.num_experts_per_tok


@pytest.fixture(scope="module")
def step():
    """fp32 weights and a step at a fresh random context: (weights, inputs), drawn until the near-tie test's premise
    holds (at every MoE layer, running the (k+1)-th expert in place of the k-th moves the logits past the plain 2e-2
    bound; a draw where it does not, about one in ten, could not tell the bound's two sides apart)."""
    first = int(torch.randint(0, 1 << 16, (1,)))
    for seed in range(first, first + 100):
        bw = random_bench_weights(SPEC, seed, torch.float32, "cpu")
        inputs = decode_inputs(SPEC, 5 + seed % 7, seed=seed, dtype=torch.float32, device="cpu")
        plain = reference_logits(bw.weights, inputs)
        if all(not compare_logits(_backend(bw, inputs, _swap_at(layer))[0], plain, 2e-2).ok
               for layer in SPEC.moe_layers):
            return bw, inputs
    raise AssertionError(f"no draw of seeds {first}..{first + 99} moves the logits past 2e-2 by a swapped expert")


def _backend(bw, inputs, change):
    """A fake backend: the reference with ``change(layer, own routing) -> ids`` run at each MoE layer (its router's
    input already holds the earlier changes); returns its logits and the routing it reports (what it ran)."""
    ran = []
    logits = reference_logits(bw.weights, inputs, ran, route=lambda layer, r: follow(r, change(layer, r), SPEC))
    return logits, [r.ids.clone() for r in ran]


def _own(layer, r):
    return r.ids


def _kth_gap(r) -> tuple[int, int, float]:
    """A routing's k-th expert, its (k+1)-th, and their probability gap."""
    order = torch.argsort(r.probs[0], descending=True)
    kth, nxt = int(order[K - 1]), int(order[K])
    return kth, nxt, float(r.probs[0, kth] - r.probs[0, nxt])


def _swap_at(layer0: int):
    """At ``layer0``: run the (k+1)-th expert instead of the k-th (a near-tie when the bound reaches their gap)."""
    def change(layer, r):
        if layer != layer0:
            return r.ids
        kth, nxt, _ = _kth_gap(r)
        return torch.where(r.ids == kth, torch.full_like(r.ids, nxt), r.ids)
    return change


def test_the_own_routing_passes_exactly_and_perturbed_logits_fail(step):
    bw, inputs = step
    logits, routing = _backend(bw, inputs, _own)
    c = own_route_check(logits, bw.weights, inputs, routing, tie=1e-3)
    assert c.check.ok and c.check.rel_err == 0.0 and c.near_ties == 0 and c.bad_layer is None, c
    assert c.check.detail == "ok (own routing; 0 near-ties)" and c.gaps == (0.0, 0.0)
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    bad = logits + 0.05 * logits.std() * torch.randn(logits.shape, generator=g)  # (c): right routing, wrong numbers
    c = own_route_check(bad, bw.weights, inputs, routing, tie=1e-3)
    assert not c.check.ok and c.check.detail.startswith("rel_err") and "(own routing; 0 near-ties)" in c.check.detail
    assert c.bad_layer is None
    assert not own_route_check(torch.full_like(logits, float("nan")), bw.weights, inputs, routing, 1e-3).check.ok


@pytest.mark.parametrize("layer", SPEC.moe_layers)
def test_a_near_tie_routing_passes_within_the_bound_and_fails_past_it(step, layer):
    """(a) and (b): the backend takes the (k+1)-th expert at one layer; the bound decides whether that is a near-tie."""
    bw, inputs = step
    logits, routing = _backend(bw, inputs, _swap_at(layer))
    seen = []
    reference_logits(bw.weights, inputs, seen, route=lambda li, r: follow(r, routing[SPEC.moe_layers.index(li)], SPEC))
    gap = _kth_gap(seen[SPEC.moe_layers.index(layer)])[2]  # the swapped layer's own k-th/(k+1)-th gap
    # the premise (the fixture's draw): the other expert's share moves the logits past the plain bound
    assert not compare_logits(logits, reference_logits(bw.weights, inputs), 2e-2).ok
    c = own_route_check(logits, bw.weights, inputs, routing, tie=2 * gap + 1e-6)
    assert c.check.ok and c.check.rel_err < 1e-5 and c.near_ties == 1, c
    assert c.check.detail == "ok (own routing; 1 near-tie)"
    assert c.gaps[SPEC.moe_layers.index(layer)] == pytest.approx(gap, rel=1e-5)
    c = own_route_check(logits, bw.weights, inputs, routing, tie=gap / 2)
    assert not c.check.ok and c.bad_layer == layer, c
    assert c.check.detail.startswith(f"routing not faithful at layer {layer} (gap ")


def test_a_wrong_expert_fails_naming_its_layer(step):
    """(b): the second MoE layer runs its least probable expert in place of its top one (a router bug)."""
    bw, inputs = step
    last = SPEC.moe_layers[-1]

    def change(layer, r):
        ids = r.ids.clone()
        if layer == last:
            ids[0, 0] = int(r.probs[0].argmin())
        return ids
    logits, routing = _backend(bw, inputs, change)
    c = own_route_check(logits, bw.weights, inputs, routing, tie=1e-2)
    assert not c.check.ok and c.bad_layer == last and c.gaps[0] == 0.0, c
    assert f"routing not faithful at layer {last} (gap" in c.check.detail and "> tie 0.01" in c.check.detail
    # a routing that is no valid set (an expert twice, a layer missing) fails too
    dup = [routing[0], torch.tensor([[1, 1, 2, 3]])]
    c = own_route_check(logits, bw.weights, inputs, dup, tie=1.0)
    assert not c.check.ok and c.bad_layer == last and "gap inf" in c.check.detail
    c = own_route_check(logits, bw.weights, inputs, routing[:1], tie=1.0)
    assert not c.check.ok and "names 1 MoE layers, the model has 2" in c.check.detail


def test_the_worker_reference_judges_a_reported_routing(step):
    """Reference.check with a routing: the own-routing verdict in the row, no enumeration run."""
    bw, inputs = step
    ref = Reference(bw, inputs, torch.bfloat16)  # fp32 weights: the bf16 path measures a (tiny) near-tie bound
    logits, routing = _backend(bw, inputs, _own)
    c = ref.check(logits, routing)
    assert c["ok"] and c["routing_source"] == "own" and c["route_tie"] == ref.route_tie and c["near_ties"] == 0, c
    assert ref._routes is None  # the enumeration never ran
    c = ref.check(logits * 1.1, routing)
    assert not c["ok"] and "own routing" in c["detail"]
    assert c["rel_err_fp32"] is not None
    swapped, routing = _backend(bw, inputs, _swap_at(SPEC.moe_layers[0]))
    c = ref.check(swapped, routing)  # fp32 weights: both references alike, so the near-tie bound is 0
    assert ref.route_tie == 0.0 and not c["ok"] and c["unfaithful_layer"] == SPEC.moe_layers[0], c
    assert c["rel_err_fp32"] is None  # the fp32 reference's routing is not this backend's
    c = ref.check(logits)  # no routing reported: the enumeration
    assert c["ok"] and c["routing_source"] == "enumerated" and c["routings"] >= 1


def test_the_torch_peers_report_the_routing_they_ran(step):
    bw, inputs = step
    peer = torch_eager(PeerContext(bw, inputs, torch.device("cpu"), max_steps=2))
    with torch.no_grad():
        peer.step()
    want = []
    reference_logits(bw.weights, inputs, want)
    got = peer.routing()
    assert [sorted(g.reshape(-1).tolist()) for g in got] == [sorted(r.ids.reshape(-1).tolist()) for r in want]
    c = own_route_check(peer.logits(), bw.weights, inputs, got, tie=1e-4)
    assert c.check.ok and c.check.rel_err < 1e-4, c


def test_a_compiled_decoder_records_its_routing(step):
    """Under torch.compile (traced here by Dynamo, fullgraph; bf16, as the grouped GEMMs' tracing requires) the record
    is a side effect of the compiled step, in one graph: the same experts as the eager module's record of the step."""
    from torch._dynamo.utils import counters

    _, inputs = step
    bw = random_bench_weights(SPEC, int(torch.randint(0, 1 << 16, (1,))), torch.bfloat16, "cpu")
    inputs = decode_inputs(SPEC, inputs.context, dtype=torch.bfloat16, device="cpu")
    tok, pos = torch.tensor([inputs.token]), torch.tensor([inputs.context])
    eager, m = FusedDecoder(bw, 16), FusedDecoder(bw, 16)
    for d in (eager, m):
        d.load_prefix(inputs)
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.no_grad():
            want = eager(tok, pos)
            fn = torch.compile(m, backend="eager", fullgraph=True)
            for i in range(3):  # the first call stores over None, the later ones over poisoned ids: one graph
                for layer in m.layers:
                    layer.last_ids = None if layer.router is None or i == 0 else torch.full((1, K), -1)
                out = fn(tok, pos)
            graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs == 1
    assert [g.tolist() for g in m.routing()] == [g.tolist() for g in eager.routing()]
    assert all(int(g.min()) >= 0 for g in m.routing())
    assert torch.equal(out, want)


def test_the_megakernel_reader_takes_the_steps_tagged_entries():
    """(d): a fake routing table (CPU) as the megakernel leaves it: layer l's slots tagged with the step's epoch."""
    epoch = int(torch.randint(1, 1 << 20, (1,)))
    slots = 6
    routed = torch.zeros(SPEC.num_layers, slots, dtype=torch.int32)  # 0: never written (layer 1 is dense)
    experts = {0: [9, 2, 14, 5], 2: [3, 11, 7, 0]}
    for layer, es in experts.items():
        row = es + [isa.NO_EXPERT] * (slots - len(es))
        routed[layer] = torch.tensor([isa.route_entry(e, epoch) for e in row], dtype=torch.int32)
    got = routing_entries(routed, epoch, SPEC.moe_layers)
    assert [g.tolist() for g in got] == [[sorted(experts[0])], [sorted(experts[2])]]
    assert all(g.dtype == torch.int64 for g in got)
    with pytest.raises(ValueError, match="layer 0 slot 0 is stale"):
        routing_entries(routed, epoch + 1, SPEC.moe_layers)  # the next step's reader: nothing of its own yet
    routed[2, 3] = isa.route_entry(7, epoch - 1)  # one entry the step did not write
    with pytest.raises(ValueError, match="layer 2 slot 3 is stale"):
        routing_entries(routed, epoch, SPEC.moe_layers)
    routed[2, 3] = isa.route_entry(3, epoch)  # an expert named twice reaches the check as such
    assert routing_entries(routed, epoch, SPEC.moe_layers)[1].tolist() == [[3, 3, 7, 11]]


def test_the_megakernel_readers_routing_feeds_the_check(step):
    """The reader's output as the check takes it: the reference's own routing written as a table passes."""
    bw, inputs = step
    epoch = 77
    want = []
    logits = reference_logits(bw.weights, inputs, want)
    routed = torch.zeros(SPEC.num_layers, K + 2, dtype=torch.int32)
    for layer, r in zip(SPEC.moe_layers, want):
        row = r.ids[0].tolist()[::-1] + [isa.NO_EXPERT] * 2
        routed[layer] = torch.tensor([isa.route_entry(e, epoch) for e in row], dtype=torch.int32)
    c = own_route_check(logits, bw.weights, inputs, routing_entries(routed, epoch, SPEC.moe_layers), tie=1e-4)
    # the same experts (their weights summed in another order than the router's: rounding only)
    assert c.check.ok and c.check.rel_err < 1e-5 and c.near_ties == 0 and c.gaps == (0.0, 0.0), c
