"""The release hold's marks (hold.py): host logic, on the CPU."""
import pytest
import torch

from mimw.megakernel import isa
from mimw.megakernel.hold import check_marks, hold_marks, mark_words
from mimw.megakernel.ops import CLASSES
from mimw.megakernel.plan import Tuning
from mimw.megakernel.program import StepShape, build_program
from mimw.models.spec import get_preset

CASES = [("smollm2-135m", 72, 300), ("llama-3.2-1b", 132, 1024), ("llama-3.1-8b", 132, 1024), ("qwen3-8b", 132, 17),
         ("smollm2-135m", 8, 40)]
QUIET = Tuning().quiet


def _program(model, sms, context):
    spec = get_preset(model)
    return build_program(spec, StepShape((1,), context), sms, Tuning().resolve(spec).program_config())


def _signalling_streaming(ins):
    return ins.tiles.n_tiles > 0 and ins.signal != isa.NO_COUNTER


def _assert_marks_follow_the_rule(prog, quiet, marks):
    """The loader's rule, stated instruction by instruction: an instruction holds exactly when it streams more than
    ``quiet`` tiles and the SM's last signalling streaming instruction before it exists and waits for another
    counter; that instruction's release, and only such a release, is announced."""
    for s, q in enumerate(prog.queues):
        awaited = set()
        for k, ins in enumerate(q):
            prev = [j for j in range(k) if _signalling_streaming(q[j])]
            should = ins.tiles.n_tiles > quiet and bool(prev) and q[prev[-1]].wait != ins.wait
            assert bool(marks[s][k] & isa.HOLD_WAIT) == should, (s, k, ins)
            if should:
                awaited.add(prev[-1])
        announced = {k for k, m in enumerate(marks[s]) if m & isa.HOLD_ARRIVE}
        assert announced == awaited, s
        assert all(_signalling_streaming(q[j]) for j in announced)


@pytest.mark.parametrize("model,sms,context", CASES)
def test_every_announced_release_is_waited_for_and_every_hold_has_its_release(model, sms, context):
    prog = _program(model, sms, context)
    marks = hold_marks(prog, QUIET)
    check_marks(marks)
    _assert_marks_follow_the_rule(prog, QUIET, marks)
    assert any(m & isa.HOLD_WAIT for row in marks for m in row)


def test_the_marks_leave_unannounced_the_releases_nobody_waits_for():
    """SmolLM2 on 72 SMs (the sanitizer's case): some signalling streaming releases are followed on their SM by an
    instruction waiting for the same counter, or by no held one: compute does not arrive there, so no mbarrier
    phase completes unwaited (synccheck's "Missing wait")."""
    prog = _program("smollm2-135m", 72, 300)
    marks = hold_marks(prog, QUIET)
    announced = sum(bool(m & isa.HOLD_ARRIVE) for row in marks for m in row)
    releases = sum(_signalling_streaming(ins) for ins in prog.instructions())
    assert 0 < announced < releases


def test_the_marks_vanish_without_a_hold_or_past_every_instructions_tiles():
    prog = _program("llama-3.2-1b", 132, 1024)
    assert all(m == 0 for row in hold_marks(prog, -1) for m in row)
    # a hold past every instruction's tiles waits for nothing, so nothing is announced either
    assert all(m == 0 for row in hold_marks(prog, 10 ** 6) for m in row)


def test_mark_words_sets_only_the_hold_bits_of_flags():
    prog = _program("smollm2-135m", 72, 300)
    words, lens = prog.encode()
    marks = hold_marks(prog, QUIET)
    marked = mark_words(words, marks)
    hold = isa.HOLD_ARRIVE | isa.HOLD_WAIT
    flags = isa.Word.FLAGS
    assert torch.equal(marked[..., :flags], words[..., :flags]) and torch.equal(marked[..., flags + 1:],
                                                                                words[..., flags + 1:])
    assert torch.equal(marked[..., flags] & ~hold, words[..., flags])
    for s, row in enumerate(marks):
        assert marked[s, :len(row), flags].bitwise_and(hold).tolist() == row
        assert not marked[s, len(row):, flags].bitwise_and(hold).any()  # the NOP padding
    assert not words[..., flags].bitwise_and(hold).any()  # the program's own words carry no marks
    # the VM's instructions decode the same: the marks are not instruction fields
    s, k = next((s, k) for s, row in enumerate(marks) for k, m in enumerate(row) if m & isa.HOLD_ARRIVE)
    assert isa.decode(marked[s, k], CLASSES) == prog.queues[s][k]


def test_check_marks_names_a_release_nobody_waits_for_and_a_hold_without_one():
    a, w = isa.HOLD_ARRIVE, isa.HOLD_WAIT
    check_marks([[a, 0, w, w | a, w], [0, 0], []])
    with pytest.raises(ValueError, match="SM 1: the release of instruction 0 is announced and never waited for"):
        check_marks([[a, w], [a, 0, a, w]])
    with pytest.raises(ValueError, match="SM 0: the release of instruction 2 is announced and never waited for"):
        check_marks([[a, w, a]])
    with pytest.raises(ValueError, match="SM 0 instruction 1 holds for a release nobody announced"):
        check_marks([[0, w, a, w]])
