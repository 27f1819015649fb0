import pytest

from mimw.megakernel import isa
from mimw.megakernel.ops import CLASSES
from mimw.megakernel.ops.attn_in import AttnIn
from mimw.megakernel.ops.attn_partial import AttnPartial
from mimw.megakernel.ops.down_proj import DownProj
from mimw.megakernel.ops.lm_head import LmHead
from mimw.megakernel.ops.mlp_in import MlpIn
from mimw.megakernel.ops.o_proj import OProj


@pytest.mark.parametrize("ins", [
    AttnIn(layer=3, head=5, part=1, n_parts=2, ticket=7, wait=2, wait_count=4, signal=9,
           tiles=isa.TileSpan(100, 2, 4, 8, 8)),
    AttnPartial(layer=2, kv_head=1, seg=3, split=7, n_splits=16, ticket=4, wait=0, wait_count=6, signal=1),
    OProj(layer=1, row0=32, nrows=16, wait=1, wait_count=8, signal=2, tiles=isa.TileSpan(5, 1, 0, 8, 8)),
    MlpIn(layer=0, row0=0, nrows=64), DownProj(layer=9, row0=2032, nrows=16, part=1, n_parts=2,
                                              flags=isa.CLUSTER_PAIR),
    LmHead(row0=128, nrows=64), isa.Nop(),
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
    assert len({isa.CLUSTER_PAIR, isa.HOLD_ARRIVE, isa.HOLD_WAIT}) == 3


def test_every_op_has_one_module_with_its_class_solver_and_device_code():
    from mimw.megakernel import ops

    assert set(ops.OPS) == set(isa.Op) - {isa.Op.NOP}
    for op, module in ops.OPS.items():
        assert module.OP == op and CLASSES[op].OP == op
        assert callable(module.solve) and hasattr(module.compute, "fn")  # a gluon.jit function
    assert set(ops.FINISHERS) == {op for op, c in CLASSES.items() if c is not isa.Nop and _can_finish(c)}


def _can_finish(cls) -> bool:
    return any(cls(**kw).has_finisher for kw in ({}, {"flags": isa.CLUSTER_PAIR}))
