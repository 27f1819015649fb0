"""Instruction-trace summaries (CPU, synthetic timestamps) and the trace build of the kernel (sm_90a compile)."""
import pytest
import torch

from mimw.megakernel.gpu.trace import LAYER_STAGES, critical_path, format_summary, summarize
from mimw.megakernel.program import StepShape, build_program
from mimw.models.spec import get_preset


def test_summary_adds_up_waits_busy_times_and_stage_windows():
    prog = build_program(get_preset("tiny-llama"), StepShape((1,), 32), 3)
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


def test_summary_splits_attn_partial_busy_time_into_its_phases_from_the_four_extra_stamps():
    from mimw.megakernel import isa

    prog = build_program(get_preset("tiny-llama"), StepShape((1,), 256), 8)
    words, lens = prog.encode()
    trace = torch.zeros(8, words.shape[1], 8, dtype=torch.int64)
    n_attn = n_ticket = n_last = 0
    for s in range(8):
        t = 5000 + 1000 * s
        for i in range(int(lens[s])):
            trace[s, i, :4] = torch.tensor([t, t + 1000, t + 2600, t + 3000])
            if int(words[s, i, isa.Word.OP]) == isa.Op.ATTN_PARTIAL:  # q + block 0 0.5 us, later blocks 0.3, merge
                n_attn += 1                                               # and stores 0.2; a ticket on odd SMs
                trace[s, i, 4:7] = torch.tensor([t + 1500, t + 1800, t + 2000])
                if int(words[s, i, isa.Word.C]) == int(words[s, i, isa.Word.D]) - 1:  # the split with the new row:
                    n_last += 1                                                    # later blocks 0.4, merge 0.1
                    trace[s, i, 5] = t + 1900
                if s % 2:
                    n_ticket += 1
                    trace[s, i, 7] = t + 2100  # ticket 0.1 us, then the combine until stored (0.5 us)
            t += 3000
    out = summarize(trace, words, lens)
    assert n_attn and n_ticket and n_ticket < n_attn and 0 < n_last < n_attn
    ph = out["attn_phases_us"]
    assert ph["q_and_block0"] == pytest.approx(0.5)
    assert ph["later_blocks"] == pytest.approx((0.3 * (n_attn - n_last) + 0.4 * n_last) / n_attn)
    assert ph["merge_and_store"] == pytest.approx((0.2 * (n_attn - n_last) + 0.1 * n_last) / n_attn)
    last = out["attn_last_split_us"]
    assert last["later_blocks"] == pytest.approx(0.4) and last["merge_and_store"] == pytest.approx(0.1)
    assert ph["ticket"] == pytest.approx(0.1) and ph["combine"] == pytest.approx(0.5)  # only splits with a ticket
    assert out["ops"]["ATTN_PARTIAL"]["mean_busy_us"] == pytest.approx(2.0)  # the first four stamps as before
    assert "ATTN_PARTIAL busy" in format_summary(out) and "the last splits" in format_summary(out)
    assert "attn_phases_us" not in summarize(trace[:, :, :4], words, lens)  # a 4-stamp trace has no phases


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


@pytest.mark.parametrize("name,tile_rows,tile_k,o_parts,down", [
    ("llama-3.2-1b", 32, 256, 0, False), ("tiny-qwen3", 16, 512, 0, False), ("smollm2-135m", 32, 256, 0, False),
    ("llama-3.2-1b", 32, 256, 8, False), ("llama-3.1-8b", 32, 256, 4, False), ("llama-3.2-1b", 32, 256, 0, True)])
def test_tile_counts_cover_every_streamed_weight_tile_once(name, tile_rows, tile_k, o_parts, down):
    # the host mirror of the ring's tile counter: all SMs together stream each of the five matrices once (with
    # DOWN_PROJ's cluster pairs, each half its own column tiles)
    from mimw.megakernel import isa
    from mimw.megakernel.gpu.config import KernelConfig
    from mimw.megakernel.gpu.trace import tile_counts
    from mimw.megakernel.program import ProgramConfig

    spec = get_preset(name)
    cfg = (KernelConfig.for_spec(spec).program_config() if down  # the default's: ATTN_IN and DOWN_PROJ in pairs
           else ProgramConfig(tile_rows=tile_rows, tile_k=tile_k, o_parts=o_parts))
    prog = build_program(spec, StepShape((1,), 64), 132, cfg)
    pairs = [i for q in prog.queues for i in q if isinstance(i, isa.DownProj) and i.n_parts > 1]
    assert bool(pairs) == down
    kt = lambda k: -(-k // tile_k)  # noqa: E731
    heads = spec.num_heads + 2 * spec.num_kv_heads
    per_layer = (heads * spec.head_dim * kt(spec.hidden_size) + spec.hidden_size * kt(spec.q_size)
                 + 2 * spec.intermediate_size * kt(spec.hidden_size) + spec.hidden_size * kt(spec.intermediate_size))
    rows = spec.num_layers * per_layer + spec.vocab_size * kt(spec.hidden_size)  # tile rows x column tiles
    counts = tile_counts(prog, tile_rows, tile_k)
    assert sum(map(sum, counts)) * tile_rows == rows
    assert [len(c) for c in counts] == [len(q) for q in prog.queues]


def test_tile_summary_reads_slot_and_data_waits_latency_and_issue_rates():
    from mimw.megakernel.gpu.trace import format_tiles, summarize_tiles, tile_counts

    prog = build_program(get_preset("tiny-llama"), StepShape((1,), 32), 3)
    counts = tile_counts(prog, 16, 16)
    tiles = torch.zeros(3, max(map(sum, counts)), 4, dtype=torch.int64)
    for s in range(3):  # every tile: the loader waits 200 ns for its slot; compute wants the data 700 ns after
        for j in range(sum(counts[s])):  # issue and gets it at 1200 ns (even tiles) or finds it there (odd)
            t = 1000 * j
            tiles[s, j] = torch.tensor([t, t + 200, t + 900 if j % 2 == 0 else t + 1300, t + 1200 if j % 2 == 0
                                        else t + 1300])
    windows = [dict(op="MLP_IN", layer=1, first_ready_us=0.0, last_done_us=10.0),
               dict(op="ATTN_IN", layer=0, first_ready_us=0.0, last_done_us=10.0)]  # layer 0: not counted
    out = summarize_tiles(tiles, prog, 16, 16, windows)
    mlp = out["ops"]["MLP_IN"]
    assert mlp["mean_slot_wait_us"] == pytest.approx(0.2)
    assert mlp["latency_p50_us"] == pytest.approx(1.0) and mlp["latency_p90_us"] == pytest.approx(1.0)
    assert 0.3 < mlp["waited_fraction"] < 0.7 and 0.05 < mlp["mean_data_wait_us"] < 0.25
    n = sum(map(sum, counts))
    assert sum(v["tiles"] for v in out["ops"].values()) == n
    # 3 SMs issue one 512-byte tile per us each at 0.2, 1.2, ... 9.2 us: 30 tiles in the 10 us window
    assert out["issue_tbps"]["MLP_IN"] == pytest.approx(30 * 16 * 16 * 2 / 10e-6 / 1e12)
    assert "ATTN_IN" not in out["issue_tbps"]
    span = (1000 * (max(map(sum, counts)) - 1) + 1300) / 1e3
    assert out["slot_wait_fraction"] == pytest.approx(n * 0.2 / (3 * span))
    waited = sum(1 for s in range(3) for j in range(sum(counts[s])) if j % 2 == 0)
    assert out["data_wait_fraction"] == pytest.approx(waited * 0.3 / (3 * span))
    assert "data wait" in format_tiles(out)
    out["issue_tbps"]["ATTN_PARTIAL"] = 0.01  # a window without weight tiles of its own is still shown
    assert "ATTN_PARTIAL" in format_tiles(out)
    assert out["phases"] == {}  # no instruction trace given: no split of the busy time


def test_tile_summary_splits_each_instructions_busy_time_into_staging_waits_work_and_tail():
    from mimw.megakernel.gpu.trace import format_tiles, summarize_tiles, tile_counts

    prog = build_program(get_preset("tiny-llama"), StepShape((1,), 32), 3)
    counts = tile_counts(prog, 16, 16)
    tiles = torch.zeros(3, max(map(sum, counts)), 4, dtype=torch.int64)
    trace = torch.zeros(3, max(len(q) for q in prog.queues), 4, dtype=torch.int64)
    clock = 0
    for s in range(3):  # every instruction: ready at T, first tile asked for at T + 500, each tile waited for
        j = 0           # 100 ns and held 300 ns, outputs stored 700 ns after the last tile's bytes, signalled
        for i, n in enumerate(counts[s]):  # 200 ns later
            trace[s, i] = torch.tensor([clock, clock + 50, 0, 0])
            c = clock + 50 + 500
            for _ in range(n):
                tiles[s, j] = torch.tensor([c - 900, c - 800, c, c + 100])
                c += 400
                j += 1
            trace[s, i, 2] = c - 300 + 700 if n else clock + 60
            trace[s, i, 3] = trace[s, i, 2] + 200
            clock = int(trace[s, i, 3]) + 10
    out = summarize_tiles(tiles, prog, 16, 16, trace=trace)
    for op, v in out["phases"].items():
        assert v["staging_us"] == pytest.approx(0.5), op
        assert v["epilogue_us"] == pytest.approx(0.7) and v["release_us"] == pytest.approx(0.2), op
        assert v["tail_us"] == pytest.approx(0.9), op
        assert v["work_per_tile_us"] == pytest.approx(0.3), op
        n = [c for s in range(3) for c, ins in zip(counts[s], prog.queues[s]) if ins.OP.name == op]
        assert v["data_wait_us"] == pytest.approx(0.1 * sum(n) / len(n)), op
        assert v["work_us"] == pytest.approx(0.3 * (sum(n) / len(n) - 1)), op
    assert set(out["phases"]) == {name for name, v in out["ops"].items()}  # every matvec opcode, no attention
    assert "work per tile" in format_tiles(out)


@pytest.mark.slow
def test_tile_trace_build_stamps_the_ring_and_the_default_build_does_not():
    from mimw.megakernel.gpu.config import KernelConfig, compile_sm90a

    spec = get_preset("tiny-qwen3")
    ptx = compile_sm90a(spec, KernelConfig(tile_rows=16, trace_tiles=True)).asm["ptx"]
    assert ptx.count("%globaltimer") >= 4  # wants / gets a slot (loader), wants / has data (compute)


def test_issue_series_bins_the_bytes_every_loader_issued_and_the_timeline_draws_them(tmp_path):
    from mimw.megakernel.gpu.timeline import write_timeline
    from mimw.megakernel.gpu.trace import issue_series, tile_counts

    prog = build_program(get_preset("tiny-llama"), StepShape((1,), 32), 3)
    counts = tile_counts(prog, 16, 16)
    tiles = torch.zeros(3, max(map(sum, counts)), 4, dtype=torch.int64)
    for s in range(3):  # SM s issues its tile j at 5000 + 500 j ns: two tiles per microsecond per SM
        for j in range(sum(counts[s])):
            tiles[s, j] = torch.tensor([5000 + 500 * j - 100, 5000 + 500 * j, 0, 0])
    t, rate = issue_series(tiles, prog, 16, 16, bin_us=1.0, origin_ns=0)
    assert t[:3] == [0.0, 1.0, 2.0] and rate[:5] == [0.0] * 5  # nothing before 5 us on the shared clock
    assert rate[5] == pytest.approx(3 * 2 * 16 * 16 * 2 / 1e-6 / 1e12)  # 6 tiles of 512 bytes in that microsecond
    assert sum(rate) * 1e-6 * 1e12 == pytest.approx(sum(map(sum, counts)) * 512)  # every tile counted once
    windows = [dict(op="MLP_IN", layer=0, first_ready_us=5.0, last_done_us=9.0),
               dict(op="LM_HEAD", layer=0, first_ready_us=9.0, last_done_us=12.0)]
    png = tmp_path / "timeline.png"
    write_timeline((t, rate), windows, png, "tiny-llama", bandwidth_tbps=0.01)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
