"""Patches for Triton 3.6's interpreter, under which the Triton kernels run on the CPU in tests.

Applied once by tests/conftest.py when TRITON_INTERPRET=1, before any kernel runs.
"""

import numpy as np
import torch
import triton


def patch_interpreter() -> None:
    """Three gaps of Triton 3.6's interpreter that the compiled kernels do not have:
    - a tensor loop bound goes through int(1-element array), a TypeError since numpy 2.4
      (triton-lang/triton#9171, fixed after 3.6);
    - tl.dot multiplies bfloat16 operands' raw uint16 bits (triton-lang/triton#11584): widen them
      to float32 first, which is exact, as the GPU's bf16 x bf16 -> fp32 dot is;
    - a cast to float8e4nv rounds ties away from zero and drops the carry out of the mantissa
      (1.98 becomes 1.0): round to nearest even through torch's float8_e4m3fn instead, saturating
      at +-448 as the GPU's cvt.rn.satfinite does.
    The patches change nothing where the interpreter already does the right thing."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def widen(handle):
        if handle.dtype != triton.language.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), triton.language.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_widening_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max

    def create_fp_to_fp_rounding_e4m3(self, src, dst_type, rounding_mode):
        if dst_type.scalar != triton.language.float8e4nv or rounding_mode != interpreter._ir.ROUNDING_MODE.RTNE:
            return create_fp_to_fp(self, src, dst_type, rounding_mode)
        wide = torch.from_numpy(widen(src).data.astype(np.float32))
        e4m3 = wide.clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(e4m3.view(torch.uint8).numpy(), triton.language.float8e4nv)

    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index
    interpreter.InterpreterBuilder.create_dot = create_dot_widening_bf16
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp_rounding_e4m3
