"""Test-only patch of a defect of Triton's interpreter (TRITON_INTERPRET=1), applied before any kernel runs: with
numpy >= 2.4, a loop bound that is a tensor fails (`int()` of a 1-element array). Another defect, the fp32 -> fp8
cast losing the carry into the exponent (127.2 -> 64 instead of 128), the kernels avoid themselves (ROUND_FP8 in
submission.py), so that eval.py's interpreted runs are right too.
Used by the interpreted checks of tests/test_triton.py and by tests/test_bench.py's run of bench/q_quant.py."""


def patch() -> None:
    from triton.runtime import interpreter  # ImportError without triton

    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched_tensor
