"""The triton backend: a split-KV decode kernel and an LSE combine in portable Triton (kernels.py), a Gluon split
kernel for Hopper (hopper.py), their plans (plan.py) and launch (decode.py), over what they share (common.py: Triton
as imported here, the targets, the jit helpers). Importing it never fails: without Triton the backend says why it is
unusable (triton_unusable_reason)."""

from .common import TritonTarget, amd_triton_target, triton_interpreted, triton_launch_options, triton_target
from .decode import TritonDecode
from .plan import TritonKey, TritonPlan, triton_key, triton_plan, triton_unusable_reason

__all__ = ["TritonDecode", "TritonKey", "TritonPlan", "TritonTarget", "amd_triton_target", "triton_interpreted",
           "triton_key", "triton_launch_options", "triton_plan", "triton_target", "triton_unusable_reason"]
