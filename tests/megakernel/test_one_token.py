"""Verify blocks and decode tokens as the multi-token GPU kernel runs them: one-token segments (launch/one_token.py),
the host mapping. The VM running the GPU plan's program on that mapping: tests/megakernel/test_vm.py."""
import pytest

from mimw.megakernel.launch.one_token import MAX_QUERY_BLOCK, bucket_of, query_blocks, split_segments
from mimw.megakernel.plan import MIN_QUERY_BLOCK
from mimw.models.reference import Segment


def test_a_verify_block_becomes_one_token_segments_sharing_its_table_and_first_position():
    a, b, c = (1, 2), (3, 4, 5), (6,)
    one = split_segments([Segment(a, 40, 3, 3), Segment(b, 17, 1, 1), Segment(c, 5, 4, 2)])
    assert one.positions == (40, 41, 42, 17, 5, 6, 7, 8)
    assert one.block_tables == (a, a, a, b, c, c, c, c)
    assert one.firsts == (40, 40, 40, 17, 5, 5, 5, 5)
    # every token of the verify block, the decode token, the last two of the third segment
    assert one.logit_rows == (0, 1, 2, 3, 6, 7)


def test_two_segments_writing_one_sequence_and_bad_segments_are_refused():
    with pytest.raises(ValueError, match="same sequence"):
        split_segments([Segment((1, 2), 40, 2, 2), Segment((1, 2), 42, 1, 1)])
    with pytest.raises(ValueError, match="num_logits"):
        split_segments([Segment((1,), 4, 2, 3)])
    with pytest.raises(ValueError, match="length"):
        split_segments([Segment((1,), 4, 0, 0)])


def test_a_step_pads_to_its_bucket_with_a_block_on_the_padding_page():
    a, b = (1, 2), (3, 4, 5)
    q = MIN_QUERY_BLOCK  # a segment of q tokens is a query block: the step pads with a block
    one = split_segments([Segment(a, 40, q, q), Segment(b, 17, 2, 1)], pad_page=9)
    pad = bucket_of(q + 2) - (q + 2)
    assert pad > 0 and one.padding == pad and one.num_tokens == q + 2 + pad
    assert one.positions == tuple(range(40, 40 + q)) + (17, 18) + tuple(range(pad))
    assert one.block_tables == (a,) * q + (b, b) + ((9,),) * pad
    assert one.firsts == (40,) * q + (17, 17) + (0,) * pad  # the padding is one sequence of its own
    assert one.logit_rows == tuple(range(q)) + (q + 1,)  # never a padding row
    assert split_segments([Segment(a, 40, 16, 16)], pad_page=9).padding == 0  # a full bucket
    assert split_segments([Segment(a, 40, q, q)]).padding == 0  # no padding page: no padding
    with pytest.raises(ValueError, match="padding"):
        split_segments([Segment((9,), 4, 3, 3)], pad_page=9)
    with pytest.raises(ValueError, match="more than one page"):
        split_segments([Segment(a, 0, q, 1)], pad_page=9, page_size=2)


def test_a_decode_batch_pads_with_one_token_rows_so_a_bucket_is_one_layout():
    """Every batch size of a bucket runs the bucket's decode program: the padding is one-token rows at position 0 of
    the padding page (not a block), however many (past a page's rows too)."""
    tables = [(2 * i, 2 * i + 1) for i in range(32)]
    layouts = set()
    for b in range(17, 33):
        one = split_segments([Segment(t, 7 + i, 1) for i, t in enumerate(tables[:b])], pad_page=99, page_size=4)
        assert one.num_tokens == 32 and one.padding == 32 - b and one.blocks == ()
        assert one.positions[b:] == (0,) * (32 - b) and one.firsts[b:] == (0,) * (32 - b)
        assert one.block_tables[b:] == ((99,),) * (32 - b) and one.logit_rows == tuple(range(b))
        assert one.positions[:b] == tuple(7 + i for i in range(b)) and one.block_tables[:b] == tuple(tables[:b])
        layouts.add((one.num_tokens, one.blocks))
    assert layouts == {(32, ())}


def test_segments_become_attention_query_blocks_of_at_most_sixteen_tokens():
    a, b, c = (1, 2), (3, 4, 5), (6,)
    q = MIN_QUERY_BLOCK  # segments of fewer tokens attend token by token
    assert 2 < q <= MAX_QUERY_BLOCK == 16

    def ones_or_block(n):
        return (n,) if n >= q else (1,) * n
    one = split_segments([Segment(a, 40, q, q), Segment(b, 17, 1, 1), Segment(c, 5, q + 1, 2)])
    assert one.blocks == (q, 1, q + 1)  # one block a segment, a decode token alone
    # a short segment beside a block: token by token; the padding, consecutive rows on its page, likewise
    short = split_segments([Segment(a, 40, q, q), Segment(b, 17, 2, 1)], pad_page=9)
    pad = bucket_of(q + 2) - (q + 2)
    assert short.blocks == (q, 1, 1) + ones_or_block(pad) and short.positions[q + 2:] == tuple(range(pad))
    # no query block anywhere: padded as a decode batch (rows at position 0), the bucket's decode program
    two = split_segments([Segment(a, 40, 2, 2), Segment(b, 17, 1, 1), Segment(c, 5, 2, 2)], pad_page=9)
    assert two.blocks == () and two.num_tokens == 8 and two.positions == (40, 41, 17, 5, 6, 0, 0, 0)
    assert two.firsts == (40, 40, 17, 5, 5, 0, 0, 0) and two.logit_rows == (0, 1, 2, 3, 4)
    # a segment past one block: blocks of sixteen and the rest, the second continuing the first's rows
    long = split_segments([Segment(a, 40, 20, 20), Segment(b, 17, 1, 1)], pad_page=9)
    assert long.blocks == (16, 4, 1) + ones_or_block(11) and long.num_tokens == 32
    assert long.firsts[16:20] == (40,) * 4  # what attention's prefetch must not read: the first block's rows too
    # a decode batch: every block one token, the decode batch's program (no query blocks)
    assert split_segments([Segment(a, 4, 1, 1), Segment(b, 9, 1, 1)]).blocks == ()
    assert query_blocks([1, 1, 1]) == () and query_blocks([33]) == (16, 16, 1) and query_blocks([2], 1) == ()
    assert query_blocks([2, 2]) == () and query_blocks([2], least=2) == (2,) and query_blocks([18]) == (16, 2)

def test_over_an_fp8_cache_every_verify_block_stays_a_query_block():
    """A multi-token step's one-token groups stream their past K/V through the ring over bf16 only: over fp8 a
    block of two is a query block, as before the ring; over bf16 blocks shorter than MIN_QUERY_BLOCK go token by
    token (plan.min_query_block)."""
    import torch

    from mimw.kv import fp8
    from mimw.megakernel.plan import min_query_block

    segs = [Segment((1, 2), 40, 4, 4), Segment((3,), 17, 2, 2), Segment((4,), 9, 1, 1)]
    assert min_query_block(fp8.FP8) == 2 and min_query_block(torch.bfloat16) == MIN_QUERY_BLOCK > 4
    assert split_segments(segs, pad_page=9, least=min_query_block(fp8.FP8)).blocks == (4, 2, 1, 1)
    bf16 = split_segments(segs, pad_page=9, least=min_query_block(torch.bfloat16))
    assert bf16.blocks == () and bf16.positions[7:] == (0,)  # padded as a decode batch
