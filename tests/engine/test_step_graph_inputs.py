"""The graphed pass's static inputs (step_graphs.input_fields / load, CPU): a random step packed into the one
buffer reads back as ``PrefillBatch.build`` gives it (block tables up to the step's own width; the columns past it
keep what they held, never read: every read is of a page below its segment's context), and a later step of the
same pattern overwrites every input up to its width."""
import numpy as np
import torch

from mimw.engine.backends.step_graphs import input_fields, load
from mimw.prefill.batch import Piece, PrefillBatch
from mimw.step_inputs import StepInputs

PS = 16


def _step(rng: np.random.Generator, lengths, logits, width: int) -> list[Piece]:
    pieces = []
    for n, k in zip(lengths, logits):
        start = int(rng.integers(0, (width - 1) * PS - n))  # its pages fit ``width`` columns
        table = tuple(int(p) for p in rng.permutation(1000)[:-(-(start + n) // PS) + int(rng.integers(0, 3))])
        pieces.append(Piece(table, start, n, k))
    return pieces


def test_a_random_step_reads_back_as_the_batch_build_gives_it():
    rng = np.random.default_rng()
    for _ in range(25):
        b = int(rng.integers(1, 33))
        lengths = [int(n) for n in rng.integers(1, 17, b)]
        logits = [int(rng.integers(0, n + 1)) if rng.random() < 0.5 else 1 for n in lengths]
        width = int(rng.integers(4, 12))
        t, r = sum(lengths), sum(logits)
        inputs = StepInputs(input_fields(t, b, r, width + 3), "cpu")
        for _step_i in range(3):  # same pattern, new positions, tables and tokens each step
            pieces = _step(rng, lengths, logits, width)
            tokens = torch.randint(0, 50_000, (t,))
            inputs.buffer.fill_(-5)  # poison: the step must write every input
            poisoned = inputs["block_tables"].clone()
            load(inputs, tokens, PrefillBatch.arrays(pieces, PS))
            want = PrefillBatch.build(pieces, PS, "cpu")
            assert torch.equal(inputs["tokens"], tokens)
            for name in ("positions", "slots", "q_start", "seq_start", "seq_ctx", "logit_rows"):
                assert torch.equal(inputs[name], getattr(want, name)), name
            w = want.block_tables.shape[1]
            assert torch.equal(inputs["block_tables"][:, :w], want.block_tables)
            assert torch.equal(inputs["block_tables"][:, w:], poisoned[:, w:])  # past the step's width: not written


def test_the_graphs_batch_reads_the_loaded_step_through_its_views():
    rng = np.random.default_rng()
    pieces = _step(rng, [1] * 8, [1] * 8, 6)
    inputs = StepInputs(input_fields(8, 8, 8, 6), "cpu")
    load(inputs, torch.arange(8), PrefillBatch.arrays(pieces, PS))
    batch = PrefillBatch(tuple(pieces), PS, **{k: inputs[k] for k in PrefillBatch.arrays(pieces, PS)})
    later = _step(rng, [1] * 8, [1] * 8, 6)
    load(inputs, torch.arange(8, 16), PrefillBatch.arrays(later, PS))  # what a replay of the next step reads
    assert torch.equal(batch.positions, PrefillBatch.build(later, PS, "cpu").positions)
    assert batch.num_tokens == 8 and inputs["tokens"].tolist() == list(range(8, 16))


def test_decode_batches_pad_to_their_bucket_on_the_pad_page_and_their_tokens_fill_the_start():
    from mimw.engine.backends.step_graphs import padded
    from mimw.models.reference import Segment

    dec = [Segment((3, 4), 17, 1, 1), Segment((9,), 2, 1, 1), Segment((5, 6, 7), 40, 1, 1)]
    assert padded(dec, None) == dec  # no pad page: as given
    out = padded(dec, 99)
    assert out[:3] == dec and out[3:] == [Segment((99,), 0, 1, 1)] and len(out) == 4
    assert len(padded(dec * 3, 99)) == 16 and padded(dec[:2], 99) == dec[:2]  # 9 -> 16; 2 is a bucket
    verify = [Segment((3, 4), 17, 4, 4), Segment((9,), 2, 1, 1)]
    assert padded(verify, 99) == verify  # verify blocks and prompt chunks are never padded
    chunk = [Segment((9,), 0, 3, 1), Segment((8,), 5, 1, 1), Segment((7,), 5, 1, 1)]
    assert padded(chunk, 99) == chunk
    # a padded step's tokens: the real ones at the start, 0 for the padding, every other input as built
    pieces = [Piece(tuple(s.block_table), s.start, s.length, s.num_logits) for s in out]
    inputs = StepInputs(input_fields(4, 4, 4, 3), "cpu")
    inputs.buffer.fill_(-5)
    load(inputs, torch.tensor([11, 12, 13]), PrefillBatch.arrays(pieces, PS))
    assert inputs["tokens"].tolist() == [11, 12, 13, 0]
    want = PrefillBatch.build(pieces, PS, "cpu")
    assert torch.equal(inputs["slots"], want.slots) and inputs["slots"][3] == 99 * PS


def test_an_eager_step_pads_decode_batches_only_and_returns_the_real_rows(monkeypatch):
    """A pattern's first sighting runs eager through the runner: a decode batch with the padding's zero ids appended,
    any other step (a prompt chunk of many tokens in few segments) as given; the logits of the real rows only."""
    from types import SimpleNamespace

    from mimw.engine.backends import step_graphs
    from mimw.models.reference import Segment

    monkeypatch.setattr(step_graphs.torch.cuda, "graph_pool_handle", lambda: None)
    calls = []

    def forward(ids, segments, cache):
        calls.append((ids.tolist(), list(segments)))
        return torch.randn(sum(s.num_logits for s in segments), 7)

    runner = SimpleNamespace(config=SimpleNamespace(attention="gluon"), forward=forward)
    cache = SimpleNamespace(layout=SimpleNamespace(page_size=PS, num_pages=64))
    graphs = step_graphs.StepGraphs(runner, cache, pad_page=63)
    dec = [Segment((3,), 5, 1, 1), Segment((4,), 9, 1, 1), Segment((6,), 2, 1, 1)]
    out = graphs.forward(torch.tensor([21, 22, 23]), dec)
    assert out.shape == (3, 7)
    assert calls[-1] == ([21, 22, 23, 0], dec + [Segment((63,), 0, 1, 1)])
    chunk = [Segment((7, 8), 0, 20, 1), Segment((4,), 10, 1, 1)]
    out = graphs.forward(torch.arange(21), chunk)
    assert out.shape == (2, 7) and calls[-1] == (list(range(21)), chunk)
