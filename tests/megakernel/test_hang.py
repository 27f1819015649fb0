"""A hung launch: tools/hang.py's reading of one (a program's words, a fabricated trace and counters), and the PTX check
for the CTA-wide barrier that causes one (launch/compile.partition_barrier_errors)."""
import pytest
import torch

from mimw.megakernel import isa
from mimw.megakernel.plan import plan
from mimw.models.spec import get_preset
from mimw.megakernel.tools.hang import _launches, locate, main, report, signallers, verify_step


def _program():
    p = plan(get_preset("smollm2-135m"), 8)
    return p.words, p.lens, len(p.program.counters)


def _done_before(lens, cut: dict[int, int]) -> torch.Tensor:
    """A trace where SM s finished its first cut[s] instructions (every other SM all of its queue)."""
    trace = torch.zeros(len(lens), int(lens.max()), 4, dtype=torch.int64)
    for s, n in enumerate(lens.tolist()):
        trace[s, :cut.get(s, n)] = 7
    return trace


def test_a_finished_launch_has_nothing_stuck():
    words, lens, n = _program()
    counters = torch.zeros(n + 2, dtype=torch.int32)
    assert locate(words, lens, _done_before(lens, {}), counters, n) == []
    assert report(words, lens, _done_before(lens, {}), counters, n) == "every queue finished"


def test_a_stuck_wait_names_its_counter_value_target_and_unfinished_signallers():
    words, lens, n = _program()
    # SM 1 stops at its first instruction that waits on a counter; the counter's signallers on SM 2 stop too
    i = next(k for k in range(int(lens[1])) if int(words[1, k, isa.Word.WAIT]) != isa.NO_COUNTER)
    c = int(words[1, i, isa.Word.WAIT])
    sig = [(s, k) for s in range(8) for k in range(int(lens[s])) if int(words[s, k, isa.Word.SIGNAL]) == c]
    assert sig
    s2, k2 = sig[0]
    cut = {1: i}
    if s2 != 1:
        cut[s2] = k2
    counters = torch.zeros(n + 2, dtype=torch.int32)
    counters[n + 1] = 3  # the launch's epoch: targets are 4 x the count
    trace = _done_before(lens, cut)
    stuck = {st.sm: st for st in locate(words, lens, trace, counters, n)}
    st = stuck[1]
    assert (st.index, st.wait, st.value, st.finished) == (i, c, 0, i)
    assert st.target == 4 * int(words[1, i, isa.Word.WAIT_COUNT]) and st.waiting
    assert st.op == isa.Op(int(words[1, i, isa.Word.OP])).name
    assert (s2, k2, False) in signallers(words, lens, trace, c)
    text = report(words, lens, trace, counters, n)
    assert f"waiting on counter {c} (0 of {st.target})" in text and f"SM {s2} #{k2}" in text


def test_a_met_wait_is_stuck_inside_its_work():
    words, lens, n = _program()
    i = next(k for k in range(int(lens[0])) if int(words[0, k, isa.Word.WAIT]) != isa.NO_COUNTER)
    counters = torch.full((n + 2,), 1000, dtype=torch.int32)
    counters[n + 1] = 0
    st = locate(words, lens, _done_before(lens, {0: i}), counters, n)[0]
    assert not st.waiting
    assert "inside its work" in report(words, lens, _done_before(lens, {0: i}), counters, n)


def test_verify_steps_run_their_blocks_as_query_blocks_unless_per_token():
    one = verify_step([tuple(range(3))], 37, 16)
    assert one.blocks == (16,) and one.positions == tuple(range(37, 53)) and set(one.firsts) == {37}
    tables = [tuple(range(j * 2, j * 2 + 2)) for j in range(3)]
    assert verify_step(tables, 20, 4).blocks == (4, 4, 4)
    assert verify_step(tables, 20, 4, query_blocks=False).blocks == ()


class _FakeDecoder:
    """Counts launches and records whether the trace was cleared before each (the launch stamps it)."""

    def __init__(self):
        self.trace = torch.ones(2, 3, 4, dtype=torch.int64)
        self.cleared = []

    def launch(self):
        self.cleared.append(bool((self.trace == 0).all()))
        self.trace.fill_(5)


def test_repeated_launches_clear_the_trace_before_each():
    dec = _FakeDecoder()
    launches = _launches(dec, 3, graph=False)
    assert len(launches) == 3
    for launch in launches:
        launch()
    assert dec.cleared == [True, True, True]  # stamps of the launch before never read as this launch's


def test_the_options_parse_before_the_gpu_is_needed(capsys):
    if not torch.cuda.is_available():  # parsed, then refused for want of a GPU (exit 2, one line)
        assert main(["--kv-dtype", "fp8", "--steps", "3", "--graph"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--kv-dtype", "fp16"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--steps", "0"])
    assert e.value.code == 2


def test_a_cta_wide_barrier_zero_is_found_in_ptx():
    from mimw.megakernel.launch.compile import partition_barrier_errors

    ok = "bar.sync 0, 128;\n\tbarrier.sync 1, 160;\n\tbar.sync 0, 128;"
    assert partition_barrier_errors(ok, 4) == []
    assert partition_barrier_errors(ok + "\n\tbar.sync 0;", 4) == [("0", "")]  # a noinline function's
    assert partition_barrier_errors("bar.sync 0, 256;", 4) == [("0", "256")]
    with pytest.raises(ValueError, match="no barrier"):
        partition_barrier_errors("mov.u32 %r1, 0;", 4)
