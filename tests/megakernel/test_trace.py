"""Instruction-trace summaries (CPU, synthetic timestamps) and the trace build of the kernel (sm_90a compile)."""
import pytest
import torch

from mimw.megakernel.gpu.trace import LAYER_STAGES, critical_path, format_summary, summarize
from mimw.megakernel.program import StepShape, build_program
from mimw.models.spec import get_preset


def test_summary_adds_up_waits_busy_times_and_stage_windows():
    prog = build_program(get_preset("tiny-llama"), StepShape((1,), 32), 3)
    words, lens = prog.encode()
    trace = torch.zeros(3, words.shape[1], 3, dtype=torch.int64)
    for s in range(3):  # every instruction: 1 us waiting, then 2 us working, back to back; SM s starts s us late
        t = 1000 * s
        for i in range(int(lens[s])):
            trace[s, i] = torch.tensor([t, t + 1000, t + 3000])
            t += 3000
    out = summarize(trace, words, lens)
    n = int(lens.sum())
    assert sum(v["count"] for v in out["ops"].values()) == n
    assert all(v["mean_wait_us"] == pytest.approx(1.0) and v["mean_busy_us"] == pytest.approx(2.0)
               for v in out["ops"].values())
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
    assert [cp[op] for op in LAYER_STAGES] == pytest.approx([1, 2, 3, 4, 5, 6])
    assert cp["layer"] == pytest.approx(21)
    assert "critical path per layer" in format_summary(dict(step_us=1.0, ops={}, stages=windows,
                                                            critical_path_us=cp))


@pytest.mark.slow
def test_trace_build_records_globaltimer_and_the_default_build_does_not():
    from mimw.megakernel.gpu.config import KernelConfig, compile_sm90a

    spec = get_preset("tiny-qwen3")
    assert "%globaltimer" in compile_sm90a(spec, KernelConfig(tile_rows=16, trace=True)).asm["ptx"]
    assert "%globaltimer" not in compile_sm90a(spec, KernelConfig(tile_rows=16)).asm["ptx"]
