"""Instruction-trace summaries (CPU, synthetic timestamps)."""
import pytest
import torch

from mimw.megakernel.plan import Tuning
from mimw.megakernel.program import StepShape, build_program
from mimw.megakernel.tools.trace import (LAYER_STAGES, critical_path, format_summary, routing_waits, summarize,
                                         tile_counts)
from mimw.models.spec import get_preset


def test_summary_adds_up_waits_busy_times_and_stage_windows():
    spec = get_preset("tiny-llama")
    prog = build_program(spec, StepShape((1,), 32), 3, Tuning().resolve(spec).program_config())
    words, lens = prog.encode()
    trace = torch.zeros(3, words.shape[1], 4, dtype=torch.int64)
    for s in range(3):  # every instruction: 1 us waiting, then 2 us working (the last 0.4 us its release), back to
        t = 1000 * s    # back; SM s starts s us late
        for i in range(int(lens[s])):
            trace[s, i] = torch.tensor([t, t + 1000, t + 2600, t + 3000])
            t += 3000
    out = summarize(trace, words, lens)
    n = int(lens.sum())
    assert sum(v["count"] for v in out["ops"].values()) == n
    assert all(v["mean_wait_us"] == pytest.approx(1.0) and v["mean_busy_us"] == pytest.approx(2.0)
               and v["mean_release_us"] == pytest.approx(0.4) for v in out["ops"].values())
    assert out["step_us"] == pytest.approx(max(1 + 3 * int(lens[s]) for s in range(3)) + 0.0, abs=3)
    first = out["stages"][0]
    assert first["op"] == "ATTN_IN" and first["layer"] == 0 and first["first_ready_us"] == pytest.approx(1.0)
    assert "ATTN_IN" in format_summary(out)


def test_critical_path_is_each_stages_share_of_a_layer_after_the_first():
    windows, t = [], 0.0
    for layer in range(3):
        for k, op in enumerate(LAYER_STAGES):
            t += (k + 1) * (10 if layer == 0 else 1)  # layer 0 is slow (cold start) and must not count
            windows.append(dict(op=op, layer=layer, first_ready_us=t - 0.5, last_done_us=t))
    windows.append(dict(op="LM_HEAD", layer=0, first_ready_us=t, last_done_us=t + 50))
    cp = critical_path(windows)
    assert [cp[op] for op in LAYER_STAGES] == pytest.approx([1, 2, 3, 4, 5])
    assert cp["layer"] == pytest.approx(15)
    assert "critical path per layer" in format_summary(dict(step_us=1.0, ops={}, stages=windows,
                                                            critical_path_us=cp))


def test_tile_counts_are_the_spans_and_cover_every_weight_tile_once():
    from mimw.megakernel.plan import plan

    p = plan(get_preset("llama-3.2-1b"), 132)
    counts = tile_counts(p.program)
    assert [len(c) for c in counts] == [len(q) for q in p.program.queues]
    assert sum(map(sum, counts)) == p.program.tiles.num_tiles


def test_the_critical_path_of_an_moe_model_follows_its_router_and_experts():
    """MoE layers end with EXPERT_DOWN (no DOWN_PROJ); a dense layer among them keeps MLP_IN / DOWN_PROJ."""
    from mimw.megakernel.tools.trace import MOE_STAGES

    windows, t = [], 0.0
    kinds = ["moe", "dense", "moe", "moe"]
    for layer, kind in enumerate(kinds):
        for k, op in enumerate(MOE_STAGES if kind == "moe" else LAYER_STAGES):
            t += k + 1
            windows.append(dict(op=op, layer=layer, first_ready_us=t - 0.5, last_done_us=t))
    cp = critical_path(windows)
    assert [cp[op] for op in MOE_STAGES] == pytest.approx([1, 2, 3, 4, 5, 6])
    assert cp["MLP_IN"] == pytest.approx(4) and cp["DOWN_PROJ"] == pytest.approx(5)
    assert cp["layer"] == pytest.approx((15 + 21 + 21) / 3)  # layers 1 (dense), 2 and 3 (MoE)


def test_the_routing_waits_are_summarized_per_layer_over_the_sms_that_waited():
    """waits [num_sms, num_layers, 2] (tagged ns, ns waited; zeros: no wait): per MoE layer the mean and longest
    wait over the SMs that waited and when the last saw its entry; a dense layer (all zeros) is left out; summarize
    carries them and format_summary prints them."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    sms, layers, origin = 6, 4, 1_000_000
    waits = torch.zeros(sms, layers, 2, dtype=torch.int64)
    ns = torch.randint(100, 20_000, (sms, layers), generator=g)
    tagged = origin + torch.randint(1_000, 900_000, (sms, layers), generator=g)
    waited = torch.rand(sms, layers, generator=g) < 0.7
    waited[0] = True  # every MoE layer has a waiting SM
    waited[:, 1] = False  # layer 1 is dense: no SM waits on a routing entry there
    waits[..., 0] = torch.where(waited, tagged, 0)
    waits[..., 1] = torch.where(waited, ns, 0)
    out = routing_waits(waits, origin)
    assert sorted(out["layers"]) == [0, 2, 3]
    for layer, v in out["layers"].items():
        m = waited[:, layer]
        assert v["sms"] == int(m.sum())
        assert v["mean_us"] == pytest.approx(float(ns[m, layer].double().mean()) / 1e3)
        assert v["max_us"] == pytest.approx(float(ns[m, layer].max()) / 1e3)
        assert v["tagged_us"] == pytest.approx((int(tagged[m, layer].max()) - origin) / 1e3)
        assert set(v) == {"sms", "mean_us", "max_us", "tagged_us"}
    assert out["mean_us"] == pytest.approx(sum(v["mean_us"] for v in out["layers"].values()) / 3)
    assert out["max_us"] == pytest.approx(float(ns[waited].max()) / 1e3)
    assert routing_waits(torch.zeros(sms, layers, 2, dtype=torch.int64)) == dict(layers={}, mean_us=0.0, max_us=0.0)

    spec = get_preset("tiny-llama")
    prog = build_program(spec, StepShape((1,), 32), 3, Tuning().resolve(spec).program_config())
    words, lens = prog.encode()
    trace = torch.zeros(3, words.shape[1], 4, dtype=torch.int64)
    for s in range(3):
        for i in range(int(lens[s])):
            trace[s, i] = torch.tensor([1, 2, 3, 4]) * (i + 1) * 1000 + origin
    summary = summarize(trace, words, lens, waits)
    assert summary["routing_waits"] == routing_waits(waits, summary["origin_ns"])
    text = format_summary(summary)
    assert "loader routing wait" in text and "prefetch" not in text
    for layer, v in out["layers"].items():  # each MoE layer's mean/longest, as printed
        assert f"L{layer} {v['mean_us']:.1f}/{v['max_us']:.1f}" in text
    assert "routing_waits" not in summarize(trace, words, lens, torch.zeros(1, dtype=torch.int64))
    assert "loader routing wait" not in format_summary(summarize(trace, words, lens))
