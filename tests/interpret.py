"""Helpers for running this package's Triton kernels on the CPU with Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported: the interpreter replaces ``@triton.jit`` at decoration time, triton's own library
included, so it needs a process of its own: ``test_interpreter.py`` starts it).

``interpreter_fixes`` works around three faults of triton 3.6's interpreter:
  * it stores bf16 as raw uint16 and its ``tl.dot`` multiplies those integers: bf16 operands are widened to fp32
    first, which is what the tensor cores compute (exact products, fp32 accumulation);
  * it turns a scalar into a Python int with ``int()`` of a one-element 1-D array, an error since numpy 2.3 (a
    loop bound loaded from memory needs it): the element is taken out first;
  * its float conversions truncate (``.to(tl.bfloat16)``) or round half up without carrying into the exponent
    (fp8), where the GPU rounds to nearest even: conversions among fp32, bf16, fp16 and fp8 e4m3 go through torch's
    (round to nearest even, as the GPU's ``cvt.rn``), so a kernel's stored bits can be compared exactly.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

_TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
          tl.float8e4nv: torch.float8_e4m3fn}
_BITS = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}


def _torch_convert(real):
    def convert(data, src, dst, rounding_mode):
        if src not in _TORCH or dst not in _TORCH or rounding_mode not in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            return real(data, src, dst, rounding_mode)
        np_in, t_in = _BITS[src.primitive_bitwidth]
        bits = torch.from_numpy(np.ascontiguousarray(data).view(np_in).copy())
        out = bits.view(_TORCH[src]).to(_TORCH[dst]).view(_BITS[dst.primitive_bitwidth][1]).numpy()
        return out.view(getattr(np, f"uint{dst.primitive_bitwidth}")).reshape(np.shape(data))
    return convert


@contextlib.contextmanager
def interpreter_fixes():
    builder = interpreter.InterpreterBuilder
    real_dot, real_patch, real_convert = builder.create_dot, interpreter._patch_lang_tensor, interpreter._convert_float

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x
        return real_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def patch_lang_tensor(tensor, scope):
        real_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    builder.create_dot = create_dot
    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._convert_float = _torch_convert(real_convert)
    try:
        yield
    finally:
        builder.create_dot = real_dot
        interpreter._patch_lang_tensor = real_patch
        interpreter._convert_float = real_convert


# what every ``*_interpreted.py`` test module takes: ``pytestmark = ONLY_INTERPRETED`` and ``from interpret import
# with_fixes`` (an autouse fixture: the module's tests run inside ``interpreter_fixes``)
ONLY_INTERPRETED = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                                      reason="runs in its own TRITON_INTERPRET=1 process (tests/test_interpreter.py)")


@pytest.fixture(autouse=True)
def with_fixes():
    with interpreter_fixes():
        yield
