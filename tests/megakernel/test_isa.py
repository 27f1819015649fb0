import pytest

from mimw.megakernel import isa
from mimw.megakernel.ops import CLASSES
from mimw.megakernel.ops.attn_in import AttnIn
from mimw.megakernel.ops.attn_partial import AttnPartial
from mimw.megakernel.ops.down_proj import DownProj
from mimw.megakernel.ops.lm_head import LmHead
from mimw.megakernel.ops.mlp_in import MlpIn
from mimw.megakernel.ops.o_proj import OProj
from mimw.megakernel.ops.expert_down import ExpertDown
from mimw.megakernel.ops.expert_in import ExpertIn
from mimw.megakernel.ops.router import Router


@pytest.mark.parametrize("ins", [
    AttnIn(layer=3, head=5, part=1, n_parts=2, ticket=7, wait=2, wait_count=4, signal=9,
           tiles=isa.TileSpan(100, 2, 4, 8, 8)),
    AttnPartial(layer=2, kv_head=1, seg=3, split=7, n_splits=16, ticket=4, wait=0, wait_count=6, signal=1),
    AttnPartial(layer=2, kv_head=1, seg=5, tokens=16, split=7, n_splits=16, ticket=4, wait=0, wait_count=6),
    OProj(layer=1, row0=32, nrows=16, wait=1, wait_count=8, signal=2, tiles=isa.TileSpan(5, 1, 0, 8, 8)),
    MlpIn(layer=0, row0=0, nrows=64), DownProj(layer=9, row0=2032, nrows=16, part=1, n_parts=2,
                                              flags=isa.CLUSTER_PAIR),
    LmHead(row0=128, nrows=64), isa.Nop(),
    Router(layer=4, row0=32, nrows=32, n_parts=4, ticket=12, wait=3, wait_count=2, signal=5,
           tiles=isa.TileSpan(64, 1, 0, 8, 8)),
    ExpertIn(layer=2, row0=48, nrows=16, slot=7, wait=5, wait_count=1, signal=6, flags=isa.EXPERT_SPAN,
             tiles=isa.TileSpan(1000, 2, 0, 8, 8, 48)),
    ExpertDown(layer=2, row0=64, n_slots=8, slot=3, ticket=9, wait=6, wait_count=24, signal=10,
               flags=isa.EXPERT_SPAN, tiles=isa.TileSpan(5000, 4, 0, 3, 3, 192)),
])
def test_encode_decode_roundtrip(ins):
    words = ins.encode()
    assert len(words) == isa.NWORDS and words[isa.Word.OP] == int(ins.OP)
    assert isa.decode(words, CLASSES) == ins


def test_decode_drops_the_hold_marks_and_rejects_unknown_opcodes_and_bad_lengths():
    words = OProj(layer=1, row0=32, nrows=16).encode()
    words[isa.Word.FLAGS] |= isa.HOLD_ARRIVE | isa.HOLD_WAIT  # the GPU's marks (hold.py): not instruction fields
    assert isa.decode(words, CLASSES) == OProj(layer=1, row0=32, nrows=16)
    with pytest.raises(ValueError, match="unknown opcode"):
        isa.decode([99] + [0] * (isa.NWORDS - 1), CLASSES)
    with pytest.raises(ValueError, match="words"):
        isa.decode([0, 1], CLASSES)


def test_kernel_constants_come_from_the_enums():
    c = isa.kernel_constants()
    assert c["NWORDS"] == isa.NWORDS and len(isa.Word) == isa.NWORDS
    assert all(c[f"OP_{o.name}"] == int(o) for o in isa.Op)
    assert all(c[f"W_{w.name}"] == int(w) for w in isa.Word)
    assert len({v for k, v in c.items() if k.startswith("OP_")}) == len(isa.Op)  # opcodes are distinct
    assert len({isa.CLUSTER_PAIR, isa.HOLD_ARRIVE, isa.HOLD_WAIT, isa.EXPERT_SPAN, isa.PEER}) == 5




def test_every_op_has_one_module_with_its_class_solver_and_device_code():
    from mimw.megakernel import ops

    assert set(ops.OPS) == set(isa.Op) - {isa.Op.NOP}
    for op, module in ops.OPS.items():
        assert module.OP == op and CLASSES[op].OP == op and callable(module.solve)
    # the MoE instructions and REDUCE (tensor parallelism) included
    assert set(ops.GPU_OPS) == set(ops.OPS)
    for module in ops.GPU_OPS.values():
        assert hasattr(module.compute, "fn")  # a gluon.jit function
    assert set(ops.FINISHERS) == {op for op, c in CLASSES.items() if c is not isa.Nop and _can_finish(c)}


def _can_finish(cls) -> bool:
    return any(cls(**kw).has_finisher for kw in ({}, {"flags": isa.CLUSTER_PAIR}))


def test_an_expert_span_keeps_its_stride_in_word_e_and_needs_its_flag():
    ins = ExpertIn(layer=1, row0=0, nrows=16, slot=2, flags=isa.EXPERT_SPAN, tiles=isa.TileSpan(10, 2, 0, 4, 4, 8))
    words = ins.encode()
    assert words[isa.XS_WORD] == 8 and words[isa.SLOT_WORD] == 2 and words[isa.Word.FLAGS] & isa.EXPERT_SPAN
    with pytest.raises(ValueError, match="EXPERT_SPAN"):
        ExpertIn(tiles=isa.TileSpan(10, 2, 0, 4, 4, 8)).encode()  # a stride without the flag
    with pytest.raises(ValueError, match="EXPERT_SPAN"):
        ExpertIn(flags=isa.EXPERT_SPAN, tiles=isa.TileSpan(10, 2, 0, 4, 4)).encode()  # the flag without a stride


def test_an_expert_span_resolves_to_expert_e_tiles():
    span = isa.TileSpan(t0=100, nr=2, k0=1, k1=3, kt=4, xs=40)
    assert span.for_expert(0).tiles() == [101, 102, 105, 106]
    assert span.for_expert(3).tiles() == [221, 222, 225, 226]
    assert span.for_expert(isa.NO_EXPERT).tiles() == [] and span.n_tiles == 4


@pytest.mark.parametrize("epoch", [0, 1, 2**14 - 1, 2**14, 2**31 - 1, -2**31, -1])
def test_routing_entries_carry_their_step_and_a_stale_one_reads_as_none(epoch):
    for e in (0, 127, isa.NO_EXPERT):
        entry = isa.route_entry(e, epoch)
        assert 0 < entry < 2**31  # a positive int32
        assert isa.routed_expert(entry, epoch) == e
        assert isa.routed_expert(entry, epoch + 1) is None  # the next step sees its own router has not run
    assert isa.routed_expert(0, epoch) is None  # a never-written (zero) entry belongs to no step


def test_a_query_blocks_tokens_pack_above_its_segment():
    one = AttnPartial(layer=2, kv_head=1, seg=3, split=7, n_splits=16).encode()
    block = AttnPartial(layer=2, kv_head=1, seg=3, tokens=16, split=7, n_splits=16).encode()
    assert one[isa.Word.B] == 3  # a segment alone: the word as it always was
    assert block[isa.Word.B] == 3 + (15 << isa.PACK_SHIFT) and block[:3] == one[:3] and block[4:] == one[4:]
    with pytest.raises(ValueError, match="does not pack"):
        AttnPartial(seg=1 << isa.PACK_SHIFT, tokens=2).encode()
    with pytest.raises(ValueError, match="does not pack"):
        AttnPartial(seg=1, tokens=0).encode()
