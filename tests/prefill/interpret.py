"""Helpers for running this package's Triton kernels on the CPU with Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported: the interpreter replaces ``@triton.jit`` at decoration time, triton's own library
included, so it needs a process of its own: ``test_interpreter.py`` starts it).

``interpreter_fixes`` works around two faults of triton 3.6's interpreter:
  * it stores bf16 as raw uint16 and its ``tl.dot`` multiplies those integers: bf16 operands are widened to fp32
    first, which is what the tensor cores compute (exact products, fp32 accumulation);
  * it turns a scalar into a Python int with ``int()`` of a one-element 1-D array, an error since numpy 2.3 (a
    loop bound loaded from memory needs it): the element is taken out first.
"""
from __future__ import annotations

import contextlib

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


@contextlib.contextmanager
def interpreter_fixes():
    builder = interpreter.InterpreterBuilder
    real_dot, real_patch = builder.create_dot, interpreter._patch_lang_tensor

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
    try:
        yield
    finally:
        builder.create_dot = real_dot
        interpreter._patch_lang_tensor = real_patch
