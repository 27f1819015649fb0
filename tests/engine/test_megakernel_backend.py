"""The megakernel backend's host logic (CPU): a multi-token step's logit rows out of the decoder's buffer."""
import torch

from mimw.engine.backends.megakernel import logit_rows


def test_logit_rows_copy_a_leading_run_as_a_slice_and_other_rows_by_index():
    out = torch.randn(8, 50)
    for rows in [(0, 1, 2), tuple(range(8)), (1, 2, 4), (3,), (0, 2), ()]:
        got = logit_rows(out, rows)
        assert got.dtype == torch.float32 and torch.equal(got, out[list(rows)])
        if rows:
            assert got.data_ptr() != out.data_ptr()  # a copy: the next launch overwrites the decoder's buffer
    kept = logit_rows(out, (0, 1)).clone()
    got = logit_rows(out, (0, 1))
    out.fill_(float("nan"))  # the next launch
    assert torch.equal(got, kept)
