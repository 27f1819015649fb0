"""StepInputs (CPU): every field a view into one buffer, a step packed on the host and loaded by one copy, the
round trip exact for random layouts and values, a partial copy touching only what it covers."""
import numpy as np
import pytest
import torch

from mimw.step_inputs import ALIGN_WORDS, Field, StepInputs


def _random_fields(rng: np.random.Generator) -> list[Field]:
    out = []
    for i in range(int(rng.integers(1, 8))):
        shape = tuple(int(n) for n in rng.integers(1, 9, size=int(rng.integers(1, 3))))
        out.append(Field(f"f{i}", torch.int32 if rng.random() < 0.5 else torch.int64, shape))
    return out


def _random_values(rng: np.random.Generator, f: Field) -> np.ndarray:
    info = np.iinfo(np.int32 if f.dtype == torch.int32 else np.int64)
    return rng.integers(info.min, info.max, size=f.shape, endpoint=True, dtype=info.dtype)


def test_views_alias_one_buffer_aligned_and_disjoint():
    rng = np.random.default_rng()
    for _ in range(20):
        fields = _random_fields(rng)
        inputs = StepInputs(fields, "cpu")
        base, size = inputs.buffer.data_ptr(), inputs.buffer.numel() * 8
        spans = []
        for f in fields:
            v = inputs[f.name]
            assert v.shape == f.shape and v.dtype == f.dtype and v.is_contiguous()
            assert v.untyped_storage().data_ptr() == inputs.buffer.untyped_storage().data_ptr()
            start = v.data_ptr()
            assert (start - base) % (ALIGN_WORDS * 8) == 0
            spans.append((start, start + v.numel() * v.element_size()))
            assert base <= spans[-1][0] and spans[-1][1] <= base + size
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two fields overlap
        inputs.buffer.fill_(0)
        inputs[fields[0].name].fill_(-1)  # a write through a view is a write into the one buffer
        assert int((inputs.buffer != 0).sum()) > 0


def test_pack_and_load_round_trips_random_layouts_and_values():
    rng = np.random.default_rng()
    for _ in range(30):
        fields = _random_fields(rng)
        inputs = StepInputs(fields, "cpu")
        for _step in range(3):  # each step through the next host buffer
            values = {f.name: _random_values(rng, f) for f in fields}
            staged = inputs.stage()
            for name, v in values.items():
                staged.array(name)[:] = v
            inputs.buffer.fill_(-7)  # poison: the copy must write every field
            inputs.load(staged)
            for name, v in values.items():
                assert np.array_equal(inputs[name].numpy(), v)


def test_a_partial_load_copies_only_up_to_a_fields_first_elements():
    fields = [Field("a", torch.int64, (3,)), Field("b", torch.int32, (5,)), Field("rows", torch.int32, (40,)),
              Field("wide", torch.int32, (4, 10), host=False)]
    inputs = StepInputs(fields, "cpu")
    assert inputs.host_words == inputs.offsets["rows"] + 20
    rng = np.random.default_rng()
    n = int(rng.integers(1, 40))
    staged = inputs.stage(inputs.end("rows", n))
    assert staged.words == inputs.offsets["rows"] + -(-n // 2)
    a, b, rows = rng.integers(-99, 99, 3), rng.integers(-99, 99, 5), rng.integers(-99, 99, n)
    staged.array("a")[:], staged.array("b")[:], staged.array("rows", n)[:] = a, b, rows
    inputs.buffer.fill_(-1)
    inputs.load(staged)
    assert inputs["a"].tolist() == a.tolist() and inputs["b"].tolist() == b.tolist()
    assert inputs["rows"][:n].tolist() == rows.tolist()
    # past the copied words: untouched (an odd n's last int32 word half goes along)
    assert (inputs["rows"][n + n % 2:] == -1).all() and (inputs["wide"] == -1).all()
    assert inputs.ring.words <= inputs.host_words  # the host buffers hold no device-only field


def test_consecutive_steps_pack_into_alternate_host_buffers_and_a_stale_stage_is_refused():
    inputs = StepInputs([Field("x", torch.int64, (4,))], "cpu")
    first, second, third = inputs.stage(), None, None
    inputs.load(first)
    second = inputs.stage()
    inputs.load(second)
    third = inputs.stage()
    assert first.buffer.ctypes.data != second.buffer.ctypes.data
    assert third.buffer.ctypes.data == first.buffer.ctypes.data
    inputs.load(third)
    big = StepInputs([Field("x", torch.int64, (4,)), Field("rows", torch.int32, (64,))], "cpu")
    small = big.stage(big.end("rows", 2))
    big.load(small)
    stale = big.stage(big.end("rows", 2))
    big.stage(big.end("rows", 64))  # staged again (and the ring grown) before ``stale`` was loaded
    with pytest.raises(RuntimeError):
        big.load(stale)


def test_layouts_it_refuses():
    with pytest.raises(ValueError, match="repeat"):
        StepInputs([Field("x", torch.int32, (2,)), Field("x", torch.int32, (2,))], "cpu")
    with pytest.raises(ValueError, match="int32 or int64"):
        StepInputs([Field("x", torch.float32, (2,))], "cpu")
    with pytest.raises(ValueError, match="device-only fields come after"):
        StepInputs([Field("d", torch.int32, (2,), host=False), Field("x", torch.int32, (2,))], "cpu")
    inputs = StepInputs([Field("x", torch.int32, (2,)), Field("d", torch.int32, (2,), host=False)], "cpu")
    with pytest.raises(ValueError):
        inputs.end("d", 1)
    with pytest.raises(ValueError):
        inputs.stage(inputs.host_words + 1)
