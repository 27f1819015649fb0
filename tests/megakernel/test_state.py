"""StepState.fill (CPU): the step arrays as the kernel and the VM read them, from host ints or a token tensor."""
import pytest
import torch

from mimw.megakernel.state import StepState, state_fields
from mimw.step_inputs import StepInputs


def _state(m: int, s: int, width: int) -> StepState:
    inputs = StepInputs(state_fields(m, s, width), "cpu")
    inputs.buffer.fill_(-1)  # poison: written entries only
    return StepState(inputs, torch.zeros(4, dtype=torch.int32))


def test_fill_writes_tokens_positions_contexts_and_only_the_tables_used_width():
    st = _state(4, 2, 8)
    st.fill([11, 12, 13, 14], [5, 30], [[4, 5], [6, 7, 8]], (3, 1))
    assert st.tokens.tolist() == [11, 12, 13, 14]
    assert st.positions.tolist() == [5, 6, 7, 30] and st.seg_ctx.tolist() == [8, 31]
    # one copy of the used width (3 columns): a shorter table's tail within it is 0, past it untouched
    assert st.block_tables.tolist() == [[4, 5, 0, -1, -1, -1, -1, -1], [6, 7, 8, -1, -1, -1, -1, -1]]


def test_fill_takes_the_tokens_as_a_tensor_without_a_host_round_trip():
    st = _state(2, 2, 4)
    st.fill(torch.tensor([7, 9], dtype=torch.int64), [3, 1], [[0], [1]], (1, 1))
    assert st.tokens.dtype == torch.int32 and st.tokens.tolist() == [7, 9]


def test_fill_refuses_a_token_count_or_a_table_that_does_not_fit():
    st = _state(2, 2, 4)
    with pytest.raises(ValueError, match="3 tokens for segments totalling 2"):
        st.fill([1, 2, 3], [3, 1], [[0], [1]], (1, 1))
    with pytest.raises(ValueError, match="segment 1: block table of 5 pages exceeds 4"):
        st.fill([1, 2], [3, 1], [[0], [1, 2, 3, 4, 5]], (1, 1))


def test_fill_writes_each_segments_first_written_position():
    st = _state(4, 2, 4)
    st.fill([1, 2, 3, 4], [40, 41], [[0], [1]], (1, 3))
    assert st.seg_new.tolist() == [40, 41]  # by default each segment's own first position
    st.fill([1, 2, 3, 4], [40, 41], [[0], [1]], (1, 3), seg_new=[38, 41])
    assert st.seg_new.tolist() == [38, 41]
    with pytest.raises(ValueError, match="seg_new"):
        st.fill([1, 2, 3, 4], [40, 41], [[0], [1]], (1, 3), seg_new=[41, 41])  # past the segment's first


def test_fill_state_views_alias_one_buffer_and_the_tokens_tensor_lands_after_the_copy():
    st = _state(3, 3, 6)
    base = st.inputs.buffer.data_ptr()
    end = base + st.inputs.buffer.numel() * 8
    for t in (st.tokens, st.positions, st.seg_ctx, st.seg_new, st.block_tables):
        assert base <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= end and t.dtype == torch.int32
    st.fill([1, 2, 3], [9, 4, 0], [[3, 1], [5], [2]], (1, 1, 1))
    st.fill(torch.tensor([70, 80, 90]), [10, 5, 1], [[3], [5, 6, 7], [2]], (1, 1, 1))
    # the host copy writes the tokens field too (stale values): the device tensor's copy comes after it
    assert st.tokens.tolist() == [70, 80, 90]
    assert st.positions.tolist() == [10, 5, 1] and st.seg_ctx.tolist() == [11, 6, 2]
    assert st.block_tables[:, :3].tolist() == [[3, 0, 0], [5, 6, 7], [2, 0, 0]]


def test_unspecialized_sizes_fall_in_one_class_of_the_jits_int_specialization():
    """Triton compiles an int argument that equals 1, or is a multiple of 16, apart; the padded sizes never are."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from mimw.megakernel.state import unspecialized

    for n in range(1, 200):
        m = unspecialized(n)
        assert m in (n, n + 1)
        assert native_specialize_impl(BaseBackend, m, False, True, True) == ("i32", "")


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"])
def test_every_layout_of_verify_blocks_in_a_bucket_passes_the_same_int_classes(model):
    """The kernel's layout-dependent int arguments (queue length, counters, splits) of random layouts of query blocks
    in a bucket, padded as the decoder passes them, specialize alike: one compiled kernel serves the bucket (the
    constants already agree, plan.plan)."""
    import random

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from mimw.megakernel.launch.one_token import query_blocks
    from mimw.megakernel.plan import MIN_QUERY_BLOCK, plan
    from mimw.megakernel.program import StepShape
    from mimw.megakernel.state import counter_slots, split_slots, unspecialized
    from mimw.models.spec import get_preset

    spec, rng = get_preset(model), random.Random(7)
    m = 16
    least = MIN_QUERY_BLOCK
    layouts = [query_blocks((least,) + (1,) * (m - least)), query_blocks((m,)), query_blocks((9, 6, 1))]
    for _ in range(3):
        cuts, left = [], m
        while left:
            cuts.append(rng.randint(least, min(left, 16)) if left >= least else 1)
            left -= cuts[-1]
        layouts.append(query_blocks(cuts))
    keys, constants = set(), set()
    for blocks in layouts:
        p = plan(spec, 132, StepShape((1,) * m, 1024, blocks))
        ints = (unspecialized(p.words.shape[1]), counter_slots(p.program), split_slots(p.program))
        keys.add(tuple(native_specialize_impl(BaseBackend, v, False, True, True) for v in ints))
        constants.add(p.constants)
    assert len(constants) == 1 and keys == {(("i32", ""),) * 3}
