"""PrefillBatch and split_passes: the host-side description of a prefill pass."""
import pytest
import torch

from mimw.prefill.batch import Piece, PrefillBatch, split_passes


def test_build_lists_positions_slots_and_logit_rows():
    b = PrefillBatch.build([Piece((9, 7, 2), 14, 4, 2), Piece((5,), 0, 3, 1)], 8, "cpu")
    assert b.positions.tolist() == [14, 15, 16, 17, 0, 1, 2]
    assert b.slots.tolist() == [7 * 8 + 6, 7 * 8 + 7, 2 * 8 + 0, 2 * 8 + 1, 40, 41, 42]
    assert b.q_start.tolist() == [0, 4] and b.seq_start.tolist() == [14, 0] and b.seq_ctx.tolist() == [18, 3]
    assert b.block_tables.tolist() == [[9, 7, 2], [5, 0, 0]]
    assert b.logit_rows.tolist() == [2, 3, 6]


def test_build_refuses_a_block_table_too_short():
    with pytest.raises(IndexError, match="needs 2 pages"):
        PrefillBatch.build([Piece((0,), 4, 5)], 8, "cpu")


def test_work_puts_the_longest_blocks_first():
    b = PrefillBatch.build([Piece((0, 1, 2, 3), 0, 50), Piece((4, 5, 6, 7, 8), 64, 10)], 16, "cpu")
    w = b.work(16).tolist()
    assert sorted(map(tuple, w)) == [(0, 0), (0, 16), (0, 32), (0, 48), (1, 0)]
    assert w[0] == [1, 0] and w[1] == [0, 48]


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 100])
def test_split_passes_keeps_every_token_and_logit_row_in_order(max_tokens):
    pieces = [Piece((0,), 0, 5, 2), Piece((1,), 3, 1, 1), Piece((2, 3), 8, 9, 4)]
    passes = split_passes(pieces, max_tokens)
    assert all(sum(p.length for p in ps) <= max_tokens for ps in passes)
    flat = [p for ps in passes for p in ps]
    for table, want in [((0,), pieces[0]), ((1,), pieces[1]), ((2, 3), pieces[2])]:
        parts = [p for p in flat if p.block_table == table]
        assert parts[0].start == want.start and sum(p.length for p in parts) == want.length
        assert all(a.start + a.length == b.start for a, b in zip(parts, parts[1:]))
        assert sum(p.num_logits for p in parts) == want.num_logits
        # logit rows are the last tokens of the piece
        rows = [p.start + p.length - 1 - i for p in parts for i in range(p.num_logits)]
        assert sorted(rows) == list(range(want.ctx - want.num_logits, want.ctx))


def test_build_matches_a_row_by_row_reading_of_random_pieces():
    import random

    rng = random.Random(3)
    for _ in range(20):
        ps = rng.choice([4, 16])
        pieces = []
        for _ in range(rng.randint(1, 9)):
            start, length = rng.randint(0, 70), rng.randint(1, 40)
            table = tuple(rng.sample(range(500), -(-(start + length) // ps) + rng.randint(0, 2)))
            pieces.append(Piece(table, start, length, rng.randint(0, length)))
        b = PrefillBatch.build(pieces, ps, "cpu")
        pos, slots, rows, t0 = [], [], [], 0
        for p in pieces:
            for i in range(p.length):
                q = p.start + i
                pos.append(q)
                slots.append(p.block_table[q // ps] * ps + q % ps)
            rows += range(t0 + p.length - p.num_logits, t0 + p.length)
            t0 += p.length
        assert b.positions.tolist() == pos and b.slots.tolist() == slots and b.logit_rows.tolist() == rows
        assert b.positions.dtype == b.slots.dtype == b.logit_rows.dtype == torch.int64
        assert b.q_start.dtype == b.seq_ctx.dtype == b.block_tables.dtype == torch.int32
        width = max(-(-p.ctx // ps) for p in pieces)
        assert b.block_tables.shape == (len(pieces), width)
        for i, p in enumerate(pieces):
            k = -(-p.ctx // ps)
            assert b.block_tables[i].tolist() == list(p.block_table[:k]) + [0] * (width - k)
