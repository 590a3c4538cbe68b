"""Test-only patches of two defects of Triton's interpreter (TRITON_INTERPRET=1), applied before any kernel runs:
  - with numpy >= 2.4, a loop bound that is a tensor fails (`int()` of a 1-element array);
  - fp32 -> fp8 rounding drops the carry into the exponent (127.2 -> 64 instead of 128).
Used by the interpreted checks of tests/test_triton.py and by tests/test_bench.py's run of bench/q_quant.py."""


def patch() -> None:
    import numpy as np
    import torch
    import triton
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    convert = interpreter._convert_float

    def patched_convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == triton.language.float8e4nv and input_dtype == triton.language.float32:
            return torch.from_numpy(np.ascontiguousarray(data)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(data, input_dtype, output_dtype, rounding_mode)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter._convert_float = patched_convert
