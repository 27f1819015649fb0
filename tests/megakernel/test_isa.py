import pytest

from mimw.megakernel import isa


@pytest.mark.parametrize("ins", [
    isa.AttnIn(layer=3, head=5, wait=2, wait_count=4, signal=9),
    isa.AttnPartial(layer=2, kv_head=1, seg=3, split=7, n_splits=16, wait=0, wait_count=6, signal=1),
    isa.AttnReduce(layer=1, kv_head=7, seg=0, n_splits=16, wait=4, wait_count=16, signal=5),
    isa.OProj(layer=1, row0=32, nrows=16, wait=1, wait_count=8, signal=2),
    isa.MlpIn(layer=0, row0=0, nrows=64), isa.DownProj(layer=9, row0=2032, nrows=16), isa.LmHead(row0=128, nrows=64),
    isa.Nop(),
])
def test_encode_decode_roundtrip(ins):
    words = ins.encode()
    assert len(words) == isa.NWORDS and words[isa.Word.OP] == int(ins.OP)
    assert isa.decode(words) == ins


def test_decode_rejects_unknown_opcode_and_bad_length():
    with pytest.raises(ValueError, match="unknown opcode"):
        isa.decode([99] + [0] * (isa.NWORDS - 1))
    with pytest.raises(ValueError, match="words"):
        isa.decode([0, 1])


def test_kernel_constants_come_from_the_enums():
    c = isa.kernel_constants()
    assert c["NWORDS"] == isa.NWORDS
    assert all(c[f"OP_{o.name}"] == int(o) for o in isa.Op)
    assert all(c[f"W_{w.name}"] == int(w) for w in isa.Word)
    assert len({v for k, v in c.items() if k.startswith("OP_")}) == len(isa.Op)  # opcodes are distinct
